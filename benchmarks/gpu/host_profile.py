"""Where the host's time goes in a decoding step: a sampling profile (pyinstrument) of greedy B = 1 calls.

The draft phase of the tree methods is host-bound on a GPU: on the H100 on 2026-11-25 the
GPU was busy 6.6 ms of an EAGLE-2 step of about 15 ms (`profile_step.py`), nearly all of it the
target's verification, while the draft phase took 6-10 ms. So the host's time per step, by
function, is where the draft phase's time goes. A sampling profiler shows it without the
per-call overhead that cProfile adds to small Python functions (which would overstate the
decision logic against torch ops).

    python benchmarks/gpu/host_profile.py --target PAIR/target --draft PAIR/draft \
        --prompts PAIR/prompts.jsonl --methods eagle2,cast,dynatree --device cuda --out OUT/host

Needs pyinstrument (not a dependency of specdec: `pip install pyinstrument`, or carry its wheel
to the GPU machine). Per method it writes `METHOD-tree.txt` (the call tree, ms a step) and
`METHOD-flat.txt` (own time by function, ms a step) and prints one summary row: steps, τ, wall,
draft and verify ms a step (the engine's own clocks, measured in a separate unprofiled pass).
Each method first decodes every prompt twice unprofiled (CUDA graphs captured for every shape
the prompts reach, costs measured), so the profile holds no one-off work.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from gpu_common import add_pair_arguments, method_items, read_prompts, sync

from specdec.api import SpeculativeDecoder


def main() -> None:
    try:
        from pyinstrument import Profiler
        from pyinstrument.renderers import ConsoleRenderer
    except ImportError as e:  # pragma: no cover - an optional tool
        raise SystemExit(f"host_profile.py needs pyinstrument ({e}): pip install pyinstrument") from e
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, methods="eagle2,cast,dynatree", num_prompts=6)
    ap.add_argument("--interval-ms", type=float, default=0.2, help="sampling interval")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.num_prompts)
    cuda = args.device.startswith("cuda")
    rows = []
    for spec, method, opts, stem in method_items(args.methods):
        dec = SpeculativeDecoder.from_pretrained(args.target, args.draft, method=method, device=args.device, **opts)

        def run_all(dec: SpeculativeDecoder = dec) -> list:
            results = []
            for prompt in prompts:
                results += dec.generate([prompt], max_new_tokens=args.max_new_tokens)
            return results

        run_all()
        run_all()  # warm: every graph captured, every cost measured
        sync(args.device)
        t0 = time.perf_counter()
        timed = run_all()  # the engine's clocks, unprofiled
        sync(args.device)
        wall_s = time.perf_counter() - t0
        profiler = Profiler(interval=args.interval_ms / 1e3)
        profiler.start()
        profiled = run_all()
        sync(args.device)
        profiler.stop()
        steps = max(1, sum(r.stats.steps for r in timed))
        profiled_steps = max(1, sum(r.stats.steps for r in profiled))
        tau = sum(r.stats.new_tokens for r in timed) / steps
        draft_ms = 1e3 * sum(r.stats.draft_s for r in timed) / steps
        verify_ms = 1e3 * sum(r.stats.verify_s for r in timed) / steps
        session = profiler.last_session
        header = f"{spec}: {profiled_steps} profiled steps; times below are seconds over all of them (divide by the steps for a step's share)\n\n"
        (out / f"{stem}-tree.txt").write_text(header + ConsoleRenderer(show_all=False).render(session))
        (out / f"{stem}-flat.txt").write_text(header + ConsoleRenderer(flat=True).render(session))
        rows.append((spec, steps, tau, 1e3 * wall_s / steps, draft_ms, verify_ms, 1e3 * session.duration / profiled_steps))
        del dec
        if cuda:
            torch.cuda.empty_cache()
    lines = ["| method | steps | τ | wall ms/step | draft ms/step | verify ms/step | profiled wall ms/step |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {m} | {s} | {t:.2f} | {w:.2f} | {d:.2f} | {v:.2f} | {p:.2f} |" for m, s, t, w, d, v, p in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
