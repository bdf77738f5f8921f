"""Greedy 96-token completions of stdlib-heldout: how many end in a loop of period <= 4 (the
issue's metric) and <= 24 (long loops too: the last 48 tokens hold two or more whole units).

Usage: python benchmarks/pair-v2-candidate/loop_periods.py MODEL_DIR
(decodes past EOS, so its short-loop counts can differ from `specdec train evaluate --loops`)."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.stats import ends_in_loop

torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
prompts = [json.loads(line)["prompt"] for line in Path("specdec/assets/pair/stdlib-heldout.jsonl").read_text(encoding="utf-8").splitlines()]
short = long = 0
for prompt in prompts:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    out = [t for t in out if t != tok.eos_token_id]
    short += ends_in_loop(out)
    long += ends_in_loop(out, max_period=24)
print(json.dumps({"model": sys.argv[1], "prompts": len(prompts), "loop_p4": short, "loop_p24": long}))
