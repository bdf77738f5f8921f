"""One-token forwards (AR) of a causal LM through `ModelRunner`: eager with dynamic shapes, eager
with static shapes, static shapes replayed as CUDA graphs (CUDA only), and `_call_static` compiled
with `torch.compile` (alone, and inside the runner's CUDA graphs on CUDA), with the KV storage laid
out as specdec lays it out (`shared`: one `[L, 2, B, H, capacity, D]` tensor, layers' keys and
values its views), one tensor a layer (`per-layer`) or separate key and value tensors a layer
(`split-kv`, as transformers' StaticCache keeps them). Prints the median ms a forward of each mode
and the largest logit difference from eager dynamic shapes.

    python benchmarks/gpu/compile_probe.py --batch-size 1 --layout split-kv
    python benchmarks/gpu/compile_probe.py --model PAIR/target --device cuda --layout split-kv \
        --modes dynamic,static,graphs,compiled,compiled-graphs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from specdec.bundled import bundled_target
from specdec.models import runner as runner_mod
from specdec.models.runner import ModelRunner


def split_layout(layout: str) -> None:
    """Replace SlotCache's storage with one tensor a layer (`per-layer`) or separate keys and
    values a layer (`split-kv`); `shared` leaves specdec's layout."""
    cache = runner_mod.SlotCache
    if layout == "shared":
        return
    if layout == "per-layer":

        def allocate(self: Any, index: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            layout = (key_states.shape[1], key_states.shape[3], value_states.shape[1], value_states.shape[3])
            b, h, d = key_states.shape[0], max(layout[0], layout[2]), max(layout[1], layout[3])
            self.extra[index], self.extra_layouts[index] = self._zeros((2, b, h, self.capacity, d), key_states), layout

        cache._allocate_layer = allocate
        return

    def allocate_kv(self: Any, index: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.extra[2 * index] = torch.zeros_like(key_states[:, :, :1]).expand(-1, -1, self.capacity, -1).contiguous()
        self.extra[2 * index + 1] = torch.zeros_like(value_states[:, :, :1]).expand(-1, -1, self.capacity, -1).contiguous()

    def map_tensors(self: Any, fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
        self.extra = {i: fn(t, 0, 2) for i, t in self.extra.items()}
        for t in self.extra.values():
            self.capacity, self.rows = t.shape[2], t.shape[0]
            break

    cache._allocate_layer = allocate_kv
    cache.kv = lambda self, index: (self.extra[2 * index], self.extra[2 * index + 1])
    cache.tensors = lambda self: [(t, 0, 2) for t in self.extra.values()]
    cache.map_tensors = map_tensors


def decode(runner: ModelRunner, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """Prefill `prompt` [B, T], then `steps` greedy one-token forwards and commits: (last logits of
    each step [B, V], ms of each step)."""
    b, dev = prompt.shape[0], prompt.device
    runner.reset(b)
    logits = runner.prefill(prompt, torch.ones_like(prompt))
    token = (logits if logits.dim() == 2 else logits[:, -1]).argmax(-1, keepdim=True)
    one = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)
    keep, keep_valid = torch.zeros(b, 1, dtype=torch.long, device=dev), torch.ones(b, 1, dtype=torch.bool, device=dev)
    outs, times = [], []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = runner.forward(token, runner.committed_len()[:, None], one)
        runner.commit(keep, keep_valid)
        token = logits[:, -1].argmax(-1, keepdim=True)  # (a host-visible result each step, as a decode loop reads its tokens)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
        outs.append(logits[:, -1].float())
    return outs, times


def compiled_runner(model: torch.nn.Module, graphs: bool) -> ModelRunner:
    """A static-shape runner whose bucketed forwards call a `torch.compile`d `_call_static`, its KV
    storage marked as static addresses (as StaticCache marks its own)."""
    runner = ModelRunner(model, static_shapes=True, cuda_graphs=graphs)
    plain = runner._call_static
    compiled = torch.compile(plain, dynamic=False)

    def call(buf: Any, logits_to_keep: int, model_inputs: Any) -> torch.Tensor:
        if logits_to_keep or model_inputs:  # prefill: one-off widths, eager
            return plain(buf, logits_to_keep, model_inputs)
        for t, _, _ in runner._cache().tensors():
            torch._dynamo.mark_static_address(t)
        return compiled(buf, logits_to_keep, model_inputs)

    runner._call_static = call  # type: ignore[method-assign]
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a causal LM folder (default: the bundled target)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (1: steady when the machine is shared)")
    parser.add_argument("--layout", choices=("shared", "per-layer", "split-kv"), default="shared")
    parser.add_argument("--modes", default="dynamic,static,compiled", help="dynamic, static, graphs (CUDA), compiled, compiled-graphs (CUDA)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = AutoModelForCausalLM.from_pretrained(args.model or bundled_target(), dtype=dtype).to(args.device).eval()
    split_layout(args.layout)
    prompt = torch.randint(5, min(1000, model.config.vocab_size), (args.batch_size, args.prompt_tokens), device=args.device)
    print(f"{args.model or 'bundled target'} on {args.device} ({dtype}), B = {args.batch_size}, layout {args.layout}, torch {torch.__version__}")
    makers: dict[str, Callable[[], ModelRunner]] = {
        "dynamic": lambda: ModelRunner(model),
        "static": lambda: ModelRunner(model, static_shapes=True),
        "graphs": lambda: ModelRunner(model, static_shapes=True, cuda_graphs=True),
        "compiled": lambda: compiled_runner(model, graphs=False),
        "compiled-graphs": lambda: compiled_runner(model, graphs=True),
    }
    reference, reference_mode = None, ""
    for mode in args.modes.split(","):
        try:
            runner = makers[mode]()
            t0 = time.perf_counter()
            decode(runner, prompt, args.steps)  # warm: compiles, captures
            warm_s = time.perf_counter() - t0
            outs, times = decode(runner, prompt, args.steps)
        except Exception as err:  # a mode that fails (a capture of compiled kernels, say) is reported, the others still run
            print(f"{mode:>16}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        if reference is None:  # the first mode that ran
            reference, reference_mode = outs, mode
        diff = max((a - b).abs().max().item() for a, b in zip(outs, reference, strict=True))
        print(f"{mode:>16}: median {statistics.median(times):7.2f} ms a forward (warm-up call {warm_s:.1f} s), max |logit diff| vs {reference_mode} {diff:.2g}", flush=True)


if __name__ == "__main__":
    main()
