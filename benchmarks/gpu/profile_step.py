"""Where a decoding step's time goes on a GPU: torch.profiler over a few greedy calls per method.

The GPU runs of 2026-11-25 found CAST and DynaTree losing to EAGLE-2 on drafting time (9.7 and
6.5 ms a step against 4.7 at B = 1 on an H200), not on verification. This profile says where
that time is: kernels (GPU busy), or the host launching ops and waiting on reads (GPU idle).

    python benchmarks/gpu/profile_step.py --target PAIR/target --draft PAIR/draft \
        --prompts PAIR/prompts.jsonl --methods eagle2,cast,dynatree --device cuda --out OUT/profile

Per method it writes `METHOD-ops.txt` (the profiler's op table, by host time and by device
time) and prints one summary row: wall ms a step, GPU kernel ms a step (the sum of kernel
durations: more than wall means overlap, far less means an idle GPU), kernels a step, and the
host's synchronising calls a step (device-to-host copies and stream or device synchronisations),
and of those the ones that held the host more than `WAIT_US` (a real wait for the device: an
asynchronous device-to-device or pinned copy returns in a few microseconds) with their host ms a
step. `--stacks` records Python stacks and writes `METHOD-waits.txt`: the specdec call sites of
those waits, most frequent first (where a step stops the host until the GPU drains).
`run.sh profile` runs it on the synthetic pair. On a CPU (`--device cpu`) only the host columns
mean anything.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import add_pair_arguments, method_items, read_prompts
from torch.profiler import ProfilerActivity, profile

from specdec.api import SpeculativeDecoder

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
"""host-side CUDA runtime calls that can wait for the device (a copy to the host waits for the stream)"""

WAIT_US = 20.0
"""a sync call whose host time is longer than this waited for the device"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, methods="eagle2,cast,dynatree", num_prompts=2, max_new_tokens=48)
    ap.add_argument("--stacks", action="store_true", help="record Python stacks: METHOD-waits.txt lists where the waits are")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.num_prompts + 1)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = []
    for label, method, opts, stem in method_items(args.methods):
        dec = SpeculativeDecoder.from_pretrained(args.target, args.draft, method=method, device=args.device, **opts)
        for _ in range(2):  # warm-up on the profiled prompts themselves (the same batch size): graphs captured, kernels loaded, costs measured
            dec.generate(prompts[1:], max_new_tokens=args.max_new_tokens)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities, with_stack=args.stacks) as prof:
            t0 = time.perf_counter()
            results = dec.generate(prompts[1:], max_new_tokens=args.max_new_tokens)
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
        steps = max(1, sum(r.stats.steps for r in results))
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.device_time for e in kernels) / 1e3 if kernels else 0.0
        sync_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in SYNC_CALLS]
        syncs = len(sync_events)
        waits = [e for e in sync_events if e.cpu_time_total > WAIT_US]
        wait_ms = sum(e.cpu_time_total for e in waits) / 1e3
        if args.stacks:
            (out / f"{stem}-waits.txt").write_text(wait_sites(waits, steps))
        table = prof.key_averages()
        text = table.table(sort_by="cpu_time_total", row_limit=40)
        if cuda:
            text += "\n\n" + table.table(sort_by="device_time_total", row_limit=40)
        (out / f"{stem}-ops.txt").write_text(text)
        tau = sum(r.stats.new_tokens for r in results) / steps
        rows.append((label, steps, tau, wall_ms / steps, kernel_ms / steps, len(kernels) / steps, syncs / steps, len(waits) / steps, wait_ms / steps))
        del dec
        if cuda:
            torch.cuda.empty_cache()
    header = f"| method | steps | τ | wall ms/step | GPU kernel ms/step | kernels/step | sync calls/step | waits/step (> {WAIT_US:g} µs) | waited ms/step |"
    lines = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {m} | {s} | {t:.2f} | {w:.2f} | {k:.2f} | {n:.0f} | {y:.1f} | {c:.1f} | {d:.2f} |" for m, s, t, w, k, n, y, c, d in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def wait_sites(waits: list[Any], steps: int) -> str:
    """The specdec call sites of the waits (the innermost specdec frames of each stack, up to three),
    with waits and host ms a step, most frequent first."""
    sites: collections.Counter[str] = collections.Counter()
    held: collections.Counter[str] = collections.Counter()
    for e in waits:
        frames = [f for f in (e.stack or []) if "specdec/" in f and "profile_step" not in f]
        site = " <- ".join(frames[:3]) or "(no specdec frame)"
        sites[site] += 1
        held[site] += e.cpu_time_total / 1e3
    lines = [f"{count / steps:6.2f} a step, {held[site] / steps:6.2f} ms  {site}" for site, count in sites.most_common(30)]
    return "waits a step, host ms a step, where (innermost first)\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
