"""Prefill cost of 16 held-out prompts one at a time against two groups of 8, target and draft
(float32, CPU): what batching a rolling batch's admissions would save here."""
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.models.runner import ModelRunner
from specdec.padding import pad_rows

dec = SpeculativeDecoder.from_pretrained(method="ar", device="cpu")
prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 16)]
print("mean prompt length", statistics.mean(map(len, prompts)))
draft = AutoModelForCausalLM.from_pretrained("specdec/assets/pair/draft", dtype=torch.float32).eval()
for name, model in (("target", dec.target), ("draft", draft)):
    runner = ModelRunner(model)
    for _ in range(3):
        t0 = time.perf_counter()
        for p in prompts:
            runner.prefill(*pad_rows([p], 0))
        single = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(0, 16, 8):
            runner.prefill(*pad_rows(prompts[i : i + 8], 0))
        grouped = time.perf_counter() - t0
        print(f"{name}: 16 one at a time {single:.3f} s, 2 groups of 8 {grouped:.3f} s", flush=True)
