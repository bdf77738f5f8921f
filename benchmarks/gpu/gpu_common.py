"""What the GPU scripts here share: a pair's command-line arguments, its prompts, `method:key=value`
specs, and device timing. The scripts run as `python benchmarks/gpu/SCRIPT.py`, which puts this
folder on sys.path."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def add_pair_arguments(ap: argparse.ArgumentParser, methods: str, num_prompts: int, max_new_tokens: int = 64) -> None:
    """--target, --draft, --prompts, --methods, --device, --num-prompts, --max-new-tokens, --out."""
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="a JSONL file with a 'prompt' field per line")
    ap.add_argument("--methods", default=methods, help="as specdec bench's: METHOD[:NAME=VALUE,...], comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--out", required=True)


def read_prompts(path: str | Path, count: int) -> list[str]:
    """The first `count` prompts of a JSONL file."""
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()][:count]


def method_items(methods: str) -> list[tuple[str, str, dict[str, object], str]]:
    """A `--methods` value as `specdec bench` reads it (`METHOD[:NAME=VALUE,...]`, parsed and
    checked by `specdec.bench.variants`) -> per item (label, method, policy options, a file-name
    stem). Accept rules (`@RULE`) are for the bench; these scripts run each method's default."""
    from specdec.bench.variants import parse_method_item, split_method_list

    items = []
    for text in split_method_list(methods):
        spec = parse_method_item(text)
        if spec.rule is not None:
            raise SystemExit(f"--methods item {text!r}: these scripts run the default accept rule; drop @{spec.rule}")
        stem = spec.text.replace(":", "_").replace("=", "-").replace(",", "_")
        items.append((spec.text, spec.method, dict(spec.options), stem))
    return items


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def host_us(call: Callable[[], object], device: torch.device, reps: int, rounds: int = 5) -> float:
    """Median over rounds of host wall µs per call (one synchronisation per round, after its loop)."""
    for _ in range(3):
        call()
    sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        sync(device)
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def gpu_us(call: Callable[[], object], device: torch.device, reps: int, rounds: int = 5) -> float | None:
    """Median over rounds of GPU µs per call (CUDA events around each round's loop); None off CUDA."""
    if device.type != "cuda":
        return None
    for _ in range(3):
        call()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            call()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / reps * 1e3)
    return statistics.median(times)


def timed_generate(decoder: Any, prompts: list[str], max_new_tokens: int, batch_size: int, device: torch.device, **sampling: Any) -> tuple[list[Any], dict[str, float]]:
    """One synchronised `decoder.generate` call: its results and tok/s, ms/step, τ and draft
    ms/step. B > 1: steps are the longest row's (a divisor that stays the same within a method:
    compare modes of one method, not methods). sampling: `generate`'s temperature, seed, ..."""
    sync(device)
    t0 = time.perf_counter()
    results = decoder.generate(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, **sampling)
    sync(device)
    wall = time.perf_counter() - t0
    steps = max(1, max(r.stats.steps for r in results) if batch_size > 1 else sum(r.stats.steps for r in results))
    new = sum(r.stats.new_tokens for r in results)
    draft = sum(r.stats.draft_s for r in results) if batch_size == 1 else results[0].stats.draft_s
    metrics = {"tok_per_s": new / wall, "ms_per_step": 1e3 * wall / steps, "tau": new / max(1, sum(r.stats.steps for r in results)), "draft_ms_per_step": 1e3 * draft / steps}
    return results, metrics
