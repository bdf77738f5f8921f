"""Where a decoding step's time goes on a GPU: torch.profiler over a few greedy calls per method.

The GPU runs of 2026-11-25 found CAST and DynaTree losing to EAGLE-2 on drafting time (9.7 and
6.5 ms a step against 4.7 at B = 1 on an H200), not on verification. This profile says where
that time is: kernels (GPU busy), or the host launching ops and waiting on reads (GPU idle).

    python benchmarks/gpu/profile_step.py --target PAIR/target --draft PAIR/draft \
        --prompts PAIR/prompts.jsonl --methods eagle2,cast,dynatree --device cuda --out OUT/profile

Per method it writes `METHOD-ops.txt` (the profiler's op table, by host time and by device
time) and prints one summary row: wall ms a step, GPU kernel ms a step (the sum of kernel
durations: more than wall means overlap, far less means an idle GPU), kernels a step, and the
host's synchronising calls a step (device-to-host copies and stream or device synchronisations).
`run.sh profile` runs it on the synthetic pair. On a CPU (`--device cpu`) only the host columns
mean anything.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from gpu_common import add_pair_arguments, method_items, read_prompts
from torch.profiler import ProfilerActivity, profile

from specdec.api import SpeculativeDecoder

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
"""host-side CUDA runtime calls that can wait for the device (a copy to the host waits for the stream)"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, methods="eagle2,cast,dynatree", num_prompts=2, max_new_tokens=48)
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
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            results = dec.generate(prompts[1:], max_new_tokens=args.max_new_tokens)
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
        steps = max(1, sum(r.stats.steps for r in results))
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.device_time for e in kernels) / 1e3 if kernels else 0.0
        syncs = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in SYNC_CALLS)
        table = prof.key_averages()
        text = table.table(sort_by="cpu_time_total", row_limit=40)
        if cuda:
            text += "\n\n" + table.table(sort_by="device_time_total", row_limit=40)
        (out / f"{stem}-ops.txt").write_text(text)
        tau = sum(r.stats.new_tokens for r in results) / steps
        rows.append((label, steps, tau, wall_ms / steps, kernel_ms / steps, len(kernels) / steps, syncs / steps))
        del dec
        if cuda:
            torch.cuda.empty_cache()
    header = "| method | steps | τ | wall ms/step | GPU kernel ms/step | kernels/step | sync calls/step |"
    lines = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {m} | {s} | {t:.2f} | {w:.2f} | {k:.2f} | {n:.0f} | {y:.1f} |" for m, s, t, w, k, n, y in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
