"""Run from the repository root: .venv/bin/python benchmarks/cpu-epyc-2026-12-02/rolling-session-47/probes/prof_noise.py. The target's forward at B = 16, n = 1, 2, 4 tokens, contexts 256 and 512, timed 8 times each as the profiler times a point."""
import statistics

import torch
from transformers import AutoModelForCausalLM

from specdec.bundled import bundled_target
from specdec.cost.profile import _fill_context, measure_forward_ms
from specdec.models.runner import ModelRunner

torch.set_num_threads(2)
m = AutoModelForCausalLM.from_pretrained(bundled_target(), dtype=torch.float32).eval()
r = ModelRunner(m)
g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    for ctx in (256, 512):
        _fill_context(r, 16, ctx, g)
        out = {1: [], 2: [], 4: []}
        for _rep in range(8):
            for n in out:
                out[n].append(round(measure_forward_ms(r, ctx, n, 1, 3, g, 30.0, 9), 1))
        for n, v in out.items():
            print(ctx, n, v, "median", statistics.median(v))
