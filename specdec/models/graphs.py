"""CUDA graphs of static-shape forwards (`--cuda-graphs auto|on|off`).

A `CudaGraphRunner` (one per model, shared by every `ModelRunner` of it) captures a model's
static-shape forward (`specdec.models.static`) once per key: batch size, node-count bucket,
capacity, and the addresses of the KV storage and input buffers the forward reads and writes.
Later forwards with the same key copy their inputs into the same buffers and replay the graph:
one launch instead of a kernel per op. Capture: one eager warm-up call on a side stream (lazy
initialisations, cuBLAS workspaces), then `torch.cuda.graph` into a memory pool shared by every
graph of the process (one graph runs at a time, so their intermediates can share memory).

If capturing or the first replay raises (an architecture whose forward reads device values on
the host, or copies from host memory, cannot be captured), the runner logs one warning naming
the model class and the reason and runs that model eagerly from then on (still in static shapes).

Built on the CPU (`tests/test_graph_replay_semantics.py` emulates capture and replay with make_fx
traces there); the CUDA tests in `tests/test_static_shapes.py` ran on an H100 on 2026-11-25.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import SpecDecError

LOG = logging.getLogger("specdec.graphs")

CUDA_GRAPH_MODES = ("auto", "on", "off")

MAX_GRAPHS = 48
"""captured graphs kept per model (least recently used dropped first)"""

_POOLS: dict[int, _Pool] = {}
"""one graph memory pool per CUDA device index, kept for the process"""


def resolve_cuda_graphs(mode: str | bool | None, device: torch.device | str) -> bool:
    """Whether forwards on `device` use CUDA graphs: 'auto' (or None) = on for CUDA, off
    elsewhere; 'on' needs a CUDA device (a SpecDecError otherwise); 'off' never."""
    if mode is None:
        mode = "auto"
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    if mode not in CUDA_GRAPH_MODES:
        raise SpecDecError(f"--cuda-graphs {mode!r} must be one of {', '.join(CUDA_GRAPH_MODES)}")
    device_type = torch.device(device).type
    if mode == "on" and device_type != "cuda":
        raise SpecDecError(f"--cuda-graphs on needs a CUDA device; the device is {device_type}; use auto or off")
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def check_cuda_graphs(mode: str | bool | None, device: str | torch.device | None) -> None:
    """Fail early (before loading models) on a bad mode, or 'on' with a device that is not CUDA;
    device None or 'auto' is checked later, against where the model was placed."""
    if device is None or str(device) == "auto":
        if mode not in (*CUDA_GRAPH_MODES, None, True, False):
            raise SpecDecError(f"--cuda-graphs {mode!r} must be one of {', '.join(CUDA_GRAPH_MODES)}")
        return
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError):
        return  # a malformed device is reported where the model is loaded
    resolve_cuda_graphs(mode, torch_device)


@dataclass(eq=False)
class _Pool:
    """A graph memory pool and the graph that keeps it alive.

    `torch.cuda.graph_pool_handle()` is a bare id with no lifetime of its own: the caching
    allocator keeps a pool's entry while some graph captured into it lives, and a capture into
    an id whose graphs are all gone fails with `it->second->use_count > 0 INTERNAL ASSERT FAILED`
    (`beginAllocateToPool`, CUDACachingAllocator.cpp). Graphs do all go: a model's
    `CudaGraphRunner` dies with its last runner (a bench's next method, a server's next model),
    and before this anchor the first capture after that gave up graphs for the model
    (measured on an H100, 2026-11-25: every method of a batch-16 sweep then ran eagerly). The
    anchor, a one-op graph captured into the pool when it is made and never dropped, keeps the
    pool's use count above zero for the life of the process."""

    handle: Any
    anchor: torch.cuda.CUDAGraph
    anchor_input: torch.Tensor


def _graph_pool(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _POOLS.get(index)
    if pool is None:
        handle = torch.cuda.graph_pool_handle()
        scratch = torch.zeros(1, device=torch.device("cuda", index))
        anchor = torch.cuda.CUDAGraph()
        with torch.cuda.device(index), torch.cuda.graph(anchor, pool=handle, capture_error_mode="thread_local"):
            scratch.add_(1)  # in place: no allocation in the pool, one node so the graph is not empty
        pool = _POOLS[index] = _Pool(handle=handle, anchor=anchor, anchor_input=scratch)
    return pool.handle


@dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # the captured forward's output, overwritten by every replay
    keepalive: Any  # the input buffers the graph reads (their addresses are part of its key)


class CudaGraphRunner:
    """Captures and replays one model's static-shape forwards; falls back to eager once for good."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_graphs: int = MAX_GRAPHS, what: str = "its forward") -> None:
        """what: what the graphs hold, for the warning when capture fails ("its forward", "its drafting levels")."""
        if device.type != "cuda":
            raise SpecDecError(f"--cuda-graphs on needs a CUDA device; the device is {device.type}; use auto or off")
        self.model_name = type(model).__name__
        self.what = what
        self.device = device
        self.max_graphs = max_graphs
        self.failed: str | None = None
        """why graphs were given up for this model (None while they work)"""
        self.captures = 0
        self.replays = 0
        self._graphs: OrderedDict[tuple[Any, ...], _Graph] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def least_recent(self) -> tuple[Any, ...] | None:
        """The key of the graph the next capture beyond `max_graphs` drops (None when there is none)."""
        return next(iter(self._graphs), None)

    def clear(self) -> None:
        """Drop every captured graph (the next run of each key captures again)."""
        self._graphs.clear()

    def run(self, key: tuple[Any, ...], call: Callable[[], torch.Tensor], keepalive: Any) -> torch.Tensor:
        """The output of `call()` (a forward that reads and writes only fixed addresses, all
        named by `key`): replayed from the graph of `key`, captured first if there is none.
        The returned tensor is overwritten by the next replay of the same graph; copy it."""
        if self.failed is not None:
            return call()
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            entry.graph.replay()
            self.replays += 1
            return entry.output
        stream = torch.cuda.current_stream(self.device)
        try:
            entry = self._capture(call, keepalive)
            entry.graph.replay()  # the capture only recorded the forward; this runs it
        except Exception as err:  # noqa: BLE001 - any failure to capture means: run this model eagerly
            torch.cuda.set_stream(stream)  # a failed capture can leave its side stream current
            self._give_up(err)
            return call()
        self.captures += 1
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry.output

    def _capture(self, call: Callable[[], torch.Tensor], keepalive: Any) -> _Graph:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            call()  # warm-up: lazy initialisations happen outside the capture
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_graph_pool(self.device), capture_error_mode="thread_local"):
            output = call()
        return _Graph(graph=graph, output=output, keepalive=keepalive)

    def _give_up(self, err: BaseException) -> None:
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        self.failed = reason
        self._graphs.clear()
        try:
            torch.cuda.synchronize(self.device)
        except Exception as sync_err:  # noqa: BLE001 - report the first error, not the aftermath
            self.failed = f"{reason} (then {type(sync_err).__name__} on synchronising)"
        LOG.warning("CUDA graphs are off for %s: capturing %s failed (%s); it runs eagerly", self.model_name, self.what, self.failed)
