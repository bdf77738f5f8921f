"""Host work per decoding step outside model forwards, the engine at a git revision (`--base`)
against this checkout's, on the bundled pair: torch ops and host reads per step (each op a
kernel launch on a GPU, each read a sync) and the wall time per step spent outside forwards
(wall time less every model forward, the prefill's included), plus tokens/s. Runs alternate between the two revisions, each in its own
process, and every number is a median over the rounds.

    python benchmarks/chain-path/host_overhead.py --base 340e732 --rounds 3 \
        --out benchmarks/chain-path/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [("chain", 0.0), ("chain", 1.0), ("static", 0.0), ("eagle2", 0.0), ("dynatree", 0.0), ("eagle2", 1.0)]
"""(method, temperature) pairs measured"""

MEASURE = r"""
import json, sys, time
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import STDLIB_HELDOUT, load_prompts, resolve_prompt_source
from specdec.hostwork import HostWorkCounter
cases, prompts_n, new = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source(STDLIB_HELDOUT))][:prompts_n]
out = {}
for method, temperature in cases:
    decoder = SpeculativeDecoder.from_pretrained(method=method)
    decoder.generate(prompts[:1], max_new_tokens=16, temperature=temperature, seed=0)  # warm-up
    with HostWorkCounter() as counter:
        counted = decoder.generate(prompts[:2], max_new_tokens=32, temperature=temperature, seed=0, batch_size=1)
    counted_steps = sum(r.stats.steps for r in counted)
    steps = tokens = 0
    outside = wall = 0.0
    for prompt in prompts:  # one call per prompt (B = 1): its wall time less every model forward (prefill's included)
        r = decoder.generate([prompt], max_new_tokens=new, temperature=temperature, seed=0)[0]
        steps += r.stats.steps
        tokens += len(r.token_ids)
        wall += r.stats.wall_s
        outside += r.stats.wall_s - r.stats.forward_s
    out[f"{method}@T={temperature:g}"] = {
        "ops_per_step": counter.ops / counted_steps,
        "reads_per_step": counter.host_reads / counted_steps,
        "outside_ms_per_step": 1000 * outside / steps,
        "tokens_per_s": tokens / wall,
        "tau": tokens / steps,
    }
print(json.dumps(out))
"""


def checkout(rev: str) -> Path:
    """A clean copy of the repository at `rev` (git archive), to import specdec from."""
    root = Path(tempfile.mkdtemp(prefix=f"specdec-{rev}-"))
    archive = subprocess.run(["git", "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def measure(src: Path, cases: list[tuple[str, float]], prompts: int, new: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(cases), str(prompts), str(new)], capture_output=True, text=True, env=env, check=True, cwd=src)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cases", default=",".join(f"{m}@{t:g}" for m, t in CASES), help="method@temperature, comma-separated")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cases = [(item.split("@")[0], float(item.split("@")[1])) for item in args.cases.split(",")]
    sources = {"base": checkout(args.base), "current": Path.cwd()}
    runs: dict[str, list[dict]] = {"base": [], "current": []}
    for round_ in range(args.rounds):
        for name in ("base", "current") if round_ % 2 == 0 else ("current", "base"):
            runs[name].append(measure(sources[name], cases, args.prompts, args.max_new_tokens))
            print(f"round {round_ + 1} {name} done", file=sys.stderr)
    table = {}
    for case in runs["base"][0]:
        row = {}
        for name in ("base", "current"):
            for metric in runs[name][0][case]:
                row[f"{name}_{metric}"] = statistics.median(r[case][metric] for r in runs[name])
        row["outside_ratio"] = row["current_outside_ms_per_step"] / row["base_outside_ms_per_step"]
        row["speed_ratio"] = row["current_tokens_per_s"] / row["base_tokens_per_s"]
        table[case] = row
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads default",
        "base": args.base,
        "current": rev + (" (with uncommitted changes)" if subprocess.run(["git", "diff", "--quiet", "HEAD"]).returncode else ""),
        "rounds": args.rounds,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "cases": table,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| case | ops/step base → now | reads/step base → now | outside ms/step base → now | ratio | tok/s base → now | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case, r in table.items():
        print(
            f"| {case} | {r['base_ops_per_step']:.0f} → {r['current_ops_per_step']:.0f} | {r['base_reads_per_step']:.1f} → {r['current_reads_per_step']:.1f} | "
            f"{r['base_outside_ms_per_step']:.2f} → {r['current_outside_ms_per_step']:.2f} | {r['outside_ratio']:.2f} | "
            f"{r['base_tokens_per_s']:.1f} → {r['current_tokens_per_s']:.1f} | {r['speed_ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
