"""What timing every model forward with CUDA events costs a decoding step: the same decoder with
the runner's forward timer on (two `torch.cuda.Event`s created and recorded per forward) and off,
in alternating rounds of one process, plus the timer's own host µs per forward.

Runners time forwards on CUDA only with SPECDEC_TIME_FORWARDS=1 since this measurement (the
script sets it, so its 'events' rounds are what every CUDA run did before). A host profile of CAST on an H100 (2026-11-25, third lease) put 12% of its profiled time in
`ModelRunner._start_timer` (`Event.record` -> `torch.cuda.current_stream`), against under 2% for
EAGLE-2 and DynaTree. Whether that time is the timer's own, or a wait that would move elsewhere
without it, is what the alternating rounds answer.

    python benchmarks/gpu/timer_ab.py --target PAIR/target --draft PAIR/draft \
        --prompts PAIR/prompts.jsonl --methods chain,eagle2,cast,dynatree --device cuda --out OUT/timer

Writes `summary.md` and `summary.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import add_pair_arguments, host_us, method_items, read_prompts, timed_generate

from specdec.api import SpeculativeDecoder
from specdec.models import runner as runner_module

_ORIGINAL = (runner_module.ModelRunner._start_timer, runner_module.ModelRunner._stop_timer)


def set_timer(mode: str, spent: list[float]) -> None:
    """mode 'events': the runner's own timer; 'off': no timer at all; 'clocked': the runner's own,
    with the host time of its two calls added to `spent` (seconds)."""
    start, stop = _ORIGINAL
    if mode == "events":
        runner_module.ModelRunner._start_timer, runner_module.ModelRunner._stop_timer = start, stop  # type: ignore[method-assign]
    elif mode == "off":
        runner_module.ModelRunner._start_timer = lambda self: None  # type: ignore[method-assign]
        runner_module.ModelRunner._stop_timer = lambda self, timer: None  # type: ignore[method-assign]
    else:

        def clocked_start(self: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return start(self)
            finally:
                spent.append(time.perf_counter() - t0)

        def clocked_stop(self: Any, timer: Any) -> None:
            t0 = time.perf_counter()
            try:
                stop(self, timer)
            finally:
                spent.append(time.perf_counter() - t0)

        runner_module.ModelRunner._start_timer, runner_module.ModelRunner._stop_timer = clocked_start, clocked_stop  # type: ignore[method-assign]


def micro(device: torch.device) -> dict[str, float]:
    """Host µs of the timer's pieces, after a small CUDA graph's replay (as in a decoding step)."""
    x = torch.zeros(1, 64, device=device)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        x.add_(1)
    stream = torch.cuda.current_stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(8)]

    def replay() -> None:
        graph.replay()

    def replay_new_event() -> None:
        graph.replay()
        torch.cuda.Event(enable_timing=True).record()

    def replay_cached_stream() -> None:
        graph.replay()
        events[0].record(stream)

    def current() -> None:
        torch.cuda.current_stream()

    return {name: host_us(call, device, reps=2000) for name, call in (("replay", replay), ("replay + new event recorded", replay_new_event), ("replay + reused event, cached stream", replay_cached_stream), ("torch.cuda.current_stream()", current))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, methods="chain,eagle2,cast,dynatree", num_prompts=12)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ[runner_module.FORWARD_TIMING_ENV] = "1"  # every runner calls its timer; 'off' rounds patch the timer out
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.num_prompts)
    device = torch.device(args.device)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "batch_size": args.batch_size, "methods": {}}
    if device.type == "cuda":
        result["micro_host_us"] = micro(device)
        print(json.dumps(result["micro_host_us"]))
    # ms/step: the call's wall time over its steps (B > 1: over the longest row's steps, a divisor
    # that stays the same within a method; compare modes, not methods)
    lines = ["| method | mode | τ | tok/s | ms/step | draft ms/step | timer host µs/forward |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for spec, method, opts, _ in method_items(args.methods):
        dec = SpeculativeDecoder.from_pretrained(args.target, args.draft, method=method, device=args.device, **opts)
        spent: list[float] = []
        set_timer("events", spent)
        for _ in range(2):
            dec.generate(prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)  # warm: graphs, costs
        per_mode: dict[str, list[dict[str, float]]] = {"events": [], "off": [], "clocked": []}
        for r in range(args.rounds):
            order = ["events", "off", "clocked"] if r % 2 == 0 else ["off", "events", "clocked"]
            for mode in order:
                spent.clear()
                set_timer(mode, spent)
                _, metrics = timed_generate(dec, prompts, args.max_new_tokens, args.batch_size, device)
                per_mode[mode].append({**metrics, "timer_us_per_call": 1e6 * statistics.mean(spent) * 2 if spent else 0.0})
        set_timer("events", [])
        summary = {}
        for mode, rows in per_mode.items():
            med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            summary[mode] = {"median": med, "rounds": rows}
            lines.append(f"| {spec} | {mode} | {med['tau']:.2f} | {med['tok_per_s']:.1f} | {med['ms_per_step']:.2f} | {med['draft_ms_per_step']:.2f} | {med['timer_us_per_call']:.1f} |")
        result["methods"][spec] = summary
        print(lines[-3], lines[-2], lines[-1], sep="\n", flush=True)
        del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(f"{result['device']}, B = {args.batch_size}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.rounds} alternating rounds\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
