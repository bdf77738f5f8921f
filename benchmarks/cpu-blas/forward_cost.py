"""The bundled pair's forward cost against the number of new tokens n, with MKL's default mode
and with MKL_CBWR=AUTO (specdec/cpu_blas.py), each in a fresh process (MKL reads the variable
once). Also one linear layer of the target's MLP shape on its own.

python benchmarks/cpu-blas/forward_cost.py [--out benchmarks/cpu-blas/forward_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

NS = (1, 2, 3, 4, 6, 8, 10, 16, 32, 64)
PREFIX = 300
"""committed tokens in the cache before the timed forwards"""

CHILD = r"""
import json, sys, time
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache
from specdec.bundled import bundled_draft, bundled_target

NS, PREFIX = json.loads(sys.argv[1]), int(sys.argv[2])

def median_ms(fn, reps):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3

out = {"threads": torch.get_num_threads()}
torch.manual_seed(0)
with torch.inference_mode():
    for which, path in (("target", bundled_target()), ("draft", bundled_draft())):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(2, 8000, (1, PREFIX)), past_key_values=cache, use_cache=True)
        row = {}
        for n in NS:
            ids = torch.randint(2, 8000, (1, n))
            pos = torch.arange(PREFIX, PREFIX + n)[None]
            mask = torch.zeros(1, 1, n, PREFIX + n)  # a 4-D additive mask, as tree verification passes
            mask[..., PREFIX:] = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
            def forward():
                model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True)
                cache.crop(-n)
            row[n] = median_ms(forward, 30)
        out[which] = row
    weight, bias = torch.randn(1792, 448), torch.randn(1792)
    out["linear_1792x448_us"] = {n: 1e3 * median_ms(lambda: F.linear(torch.randn(1, n, 448), weight, bias), 300) for n in NS}
print(json.dumps(out))
"""


def measure(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "SPECDEC_MKL_CBWR")}
    env["SPECDEC_MKL_CBWR"] = "off" if mode == "default" else mode
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(NS), str(PREFIX)], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("forward_cost.json"))
    args = parser.parse_args()
    import platform

    from specdec.cost.table import _cpu_name

    result = {"cpu": _cpu_name(), "platform": platform.platform(), "prefix": PREFIX, "modes": {}}
    for mode in ("default", "AUTO", "default", "AUTO"):  # alternated, twice: the second pair checks the first
        result["modes"].setdefault(mode, []).append(measure(mode))
    args.out.write_text(json.dumps(result, indent=1))
    for mode, runs in result["modes"].items():
        for which in ("target", "draft"):
            base = [r[which]["1"] for r in runs]
            cells = "  ".join(f"n={n}: {sum(r[which][str(n)] for r in runs) / len(runs):6.2f}" for n in NS)
            print(f"{mode:8s} {which:6s} ms  {cells}   (n=1 runs: {', '.join(f'{b:.2f}' for b in base)})")
        cells = "  ".join(f"n={n}: {sum(r['linear_1792x448_us'][str(n)] for r in runs) / len(runs):5.0f}" for n in NS)
        print(f"{mode:8s} linear us  {cells}")


if __name__ == "__main__":
    main()
