"""torch.topk over a large vocabulary against a two-stage top-k (top-k within vocabulary chunks,
then over the chunks' winners), on this device: GPU µs per call and whether the values agree.

On an H100 (2026-11-25) `torch.topk(k=8)` of [1, 8, 128256] float32 took 134-143 µs of GPU time,
once per drafted tree level. The two-stage version here was tried as a replacement and is not
used: on that H100 it took 89 µs at [1, 8, V] but 296 µs at [8, 8, V] and [1, 64, V], against
159-161 µs (`2026-11-25/h100-op-costs/topk_costs.json`).

    python benchmarks/gpu/topk_costs.py --device cuda --out OUT/topk_costs.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_common import gpu_us

_TOPK_CHUNK = (512, 2048)
"""the chunk lengths `chunked_topk` considers (a divisor of the vocabulary in this range, else padding)"""

_CHUNK_PLANS: dict[tuple[int, int, torch.device], tuple[int, int, torch.Tensor]] = {}
"""(vocabulary, k, device) -> (chunks, chunk length, [chunks, 1] first index of each chunk)"""


def _chunking(v: int) -> tuple[int, int]:
    """(chunks, chunk length) for a vocabulary of v: a divisor of v in _TOPK_CHUNK if there is
    one (no padding), else ~1024 with the last chunk padded."""
    lo, hi = _TOPK_CHUNK
    for size in range(1024, hi + 1):
        if v % size == 0:
            return v // size, size
    for size in range(1023, lo - 1, -1):
        if v % size == 0:
            return v // size, size
    chunks = -(-v // 1024)
    return chunks, -(-v // chunks)


def chunked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of x [..., V] along its last dimension, sorted
    descending, as `torch.topk(x, k, dim=-1)` gives them, in two stages: the top k of each chunk
    of about a thousand entries, then the top k of those winners. The values are exactly
    torch.topk's (every overall winner is among its chunk's k best); among equal values the
    indices may differ. Four kernels instead of one, but on a GPU `torch.topk` of a 128k
    vocabulary runs a multi-block radix select: 143 µs for [1, 8, 128256] on an H100
    (`benchmarks/gpu/op_costs.py`), once per drafted tree level. A vocabulary under 4 chunks, or
    a k above a quarter chunk, takes torch.topk."""
    v = x.shape[-1]
    key = (v, k, x.device)
    plan = _CHUNK_PLANS.get(key)
    if plan is None:
        chunks, size = _chunking(v)
        if chunks < 4 or k > size // 4:
            chunks = 0
        offsets = torch.arange(chunks, device=x.device)[:, None] * size  # [C, 1]
        plan = _CHUNK_PLANS[key] = (chunks, size, offsets)
    chunks, size, offsets = plan
    if chunks == 0:
        top = torch.topk(x, k, dim=-1)
        return top.values, top.indices
    lead = x.shape[:-1]
    if chunks * size != v:
        x = torch.nn.functional.pad(x, (0, chunks * size - v), value=float("-inf"))
    first = torch.topk(x.reshape(*lead, chunks, size), k, dim=-1)  # [..., C, k], chunk-local indices
    candidates = (first.indices + offsets).reshape(*lead, chunks * k)  # [..., C*k] vocabulary indices
    second = torch.topk(first.values.reshape(*lead, chunks * k), k, dim=-1)  # [..., k]
    return second.values, candidates.gather(-1, second.indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = []
    for shape in ((1, 1), (1, 8), (8, 8), (1, 64), (16, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            for k in (8, 10):
                x = torch.randn(*shape, args.vocab, device=dev).to(dtype)
                ref = torch.topk(x, k, dim=-1)
                values, indices = chunked_topk(x, k)
                same_values = bool(torch.equal(ref.values, values))
                same_tokens = bool(torch.equal(x.gather(-1, indices), values))
                row = {"shape": [*shape, args.vocab], "dtype": str(dtype).split(".")[-1], "k": k, "same_values": same_values, "indices_give_values": same_tokens}
                if dev.type == "cuda":
                    row["topk_us"] = gpu_us(lambda x=x, k=k: torch.topk(x, k, dim=-1), dev, reps=200)
                    row["chunked_us"] = gpu_us(lambda x=x, k=k: chunked_topk(x, k), dev, reps=200)
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
