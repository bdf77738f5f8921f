"""kosmos-2.5 text-only: last logits with default positions vs explicit 0-based (specdec) vs padding_idx+1-based position_ids"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from sweep import build, prompts_for

spec, model = build("kosmos-2.5")
prompts, _ = prompts_for(spec, model)
ids = torch.tensor([prompts[2][0]])
L = ids.shape[1]
with torch.no_grad():
    d = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    for off in (0, 2):
        p = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(off, off + L)[None]).logits[0, -1]
        print(f"position_ids start {off}: max |diff vs default| =", (p - d).abs().max().item())
