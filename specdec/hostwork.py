"""Counting the work a decoding step does *outside* model forwards.

On a GPU every tensor op issued from Python is a kernel launch (microseconds of CPU time
each, and the GPU idles while Python decides what to launch next), and every host read of
a device value (`.item()`, `.tolist()`, `bool(tensor)`, `int(tensor)`, `.cpu()`) is a full
synchronisation: the CPU waits for the GPU to drain. Both are invisible in CPU wall time,
so they are counted here, on any device:

- **ops**: aten operators dispatched outside model forwards that do work (view and
  metadata-only operators such as `view`, `slice`, `expand`, `select` are excluded: they
  launch no kernel). `ops_all` counts views too.
- **host reads**: calls that copy a tensor's value to Python (`item`, `tolist`, `__bool__`,
  `__int__`, `__float__`, `__index__`, `cpu`), and ops whose output shape depends
  on tensor values (`nonzero`, boolean-mask indexing, `masked_select`, `unique`): on a GPU
  each waits for the device as a read does. Outside model forwards.
- **host bytes**: what those calls copy (the tensor's bytes; the size-dependent ops count
  nothing): a read of a few counts is cheap, one of `[B, N, V]` distributions is a transfer
  over the bus every step.

`ModelRunner` wraps every model call in `uncounted()`, so work inside the model is not
counted; the engine wraps admission (prefill and the first token) in it too, so the counts
are per decoding step. A `HostWorkCounter` is a context manager; counting is off (and
costs one ContextVar read per model call) when none is active.

    with HostWorkCounter() as counter:
        engine.generate(...)
    counter.ops, counter.host_reads
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu"})
"""(`numpy()` is left out: it only works on a tensor already on the host, after `cpu()`)"""

_active: ContextVar[HostWorkCounter | None] = ContextVar("specdec_host_work_counter", default=None)


@contextmanager
def uncounted() -> Iterator[None]:
    """Marks work that is not a decoding step's own (a model forward, a prefill): the active counter (if any) pauses inside it."""
    counter = _active.get()
    if counter is None:
        yield
        return
    counter._inside += 1
    try:
        yield
    finally:
        counter._inside -= 1


class _OpMode(TorchDispatchMode):
    def __init__(self, counter: HostWorkCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counter = self.counter
        if not counter._inside:
            if func in _DATA_DEPENDENT_OPS or (func is torch.ops.aten.index.Tensor and _has_bool_index(args)):
                counter.host_reads += 1
                if counter.keep_names:
                    counter.read_names[str(func.overloadpacket.__name__)] += 1
            counter.ops_all += 1
            if not func.is_view and func not in _METADATA_OPS:
                counter.ops += 1
                if counter.keep_names:
                    counter.op_names[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class _ReadMode(TorchFunctionMode):
    def __init__(self, counter: HostWorkCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counter = self.counter
        if not counter._inside and getattr(func, "__name__", "") in _HOST_READS:
            counter.host_reads += 1
            if args and isinstance(args[0], torch.Tensor):
                counter.host_bytes += args[0].numel() * args[0].element_size()
            if counter.keep_names:
                counter.read_names[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


_DATA_DEPENDENT_OPS = frozenset(
    {
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten._unique2.default,
        torch.ops.aten.unique_consecutive.default,
        torch.ops.aten.unique_dim.default,
    }
)
"""ops whose output size depends on tensor values (the host must wait for the device to size the output)"""

_METADATA_OPS = frozenset(
    {
        torch.ops.aten.detach.default,
        torch.ops.aten.detach_.default,  # (in place: a tensor's autograd metadata, no kernel; inference-mode steps issue it)
        torch.ops.aten.lift_fresh.default,
        torch.ops.aten._local_scalar_dense.default,  # counted as a host read instead
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
    }
)


class HostWorkCounter:
    """Counts ops and host reads outside model forwards while active (see the module docstring)."""

    def __init__(self, keep_names: bool = False) -> None:
        self.ops = 0
        """aten ops outside model forwards that do work (views excluded)"""
        self.ops_all = 0
        """every aten op outside model forwards, views included"""
        self.host_reads = 0
        """device-to-host value reads outside model forwards"""
        self.host_bytes = 0
        """bytes those reads copied (value reads only)"""
        self.keep_names = keep_names
        self.op_names: Counter[str] = Counter()
        self.read_names: Counter[str] = Counter()
        self._inside = 0
        self._modes: list[Any] = []
        self._token: Any = None

    def __enter__(self) -> HostWorkCounter:
        self._token = _active.set(self)
        self._modes = [_ReadMode(self), _OpMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        _active.reset(self._token)


def sync_device(device: torch.device) -> None:
    """Wait for work queued on `device`, so that wall-clock timings are complete (a no-op off CUDA:
    there an op is done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_HOST_ALIGN = 8
"""bytes: every tensor's bytes start at a multiple of this in `read_together`'s transfer (so
float64 and int64 views of it are aligned)"""


def read_together(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The values of several tensors of one device on the host, in **one** transfer (one
    synchronisation on a GPU, one `cpu()` for `HostWorkCounter`) instead of one each: every
    tensor's bytes (bool as uint8, bfloat16 widened to float32, which numpy lacks) are
    concatenated on the device, padded to 8-byte boundaries, copied at once and viewed back as
    arrays of their own dtypes and shapes (views of one host buffer)."""
    if not tensors:
        return []
    dev = tensors[0].device
    chunks: list[torch.Tensor] = []
    layout: list[tuple[np.dtype[Any], tuple[int, ...], int]] = []  # per tensor: dtype, shape, padded byte count
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"read_together needs tensors of one device (got {dev} and {t.device})")
        flat = t.detach().reshape(-1)
        if flat.dtype == torch.bfloat16:
            flat = flat.float()
        elif flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        raw = flat.contiguous().view(torch.uint8)  # [numel * itemsize]
        pad = -raw.numel() % _HOST_ALIGN
        chunks.append(raw)
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=dev))
        np_dtype = np.dtype(np.bool_) if t.dtype == torch.bool else torch.empty(0, dtype=flat.dtype).numpy().dtype
        layout.append((np_dtype, tuple(t.shape), raw.numel() + pad))
    host = torch.cat(chunks).cpu().numpy()  # the one transfer
    out, start = [], 0
    for np_dtype, shape, size in layout:
        count = int(np.prod(shape, dtype=np.int64))
        out.append(host[start : start + count * np_dtype.itemsize].view(np_dtype).reshape(shape))
        start += size
    return out


class HostCopy:
    """A device tensor's values on their way to the host without a synchronisation now.

    On a GPU the copy is queued on the current stream into pinned host memory and an event is
    recorded behind it; `wait` blocks only until that event, that is until the work queued
    *before* the copy is done, not the work queued after it. A policy that starts the copy at
    the end of drafting and waits for it after the verification forward is launched plans on the
    host while the GPU verifies, where a `.tolist()` at the end of drafting would leave the GPU
    idle until the host had decided and launched the verification. On the CPU the copy is done
    when it returns. Not a host read for `HostWorkCounter` (no `.tolist()` / `.item()` of a
    device tensor: the values come back through numpy)."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.dtype == torch.bfloat16:  # (numpy has no bfloat16)
            values = values.float()
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        else:
            self._host = values.detach().clone() if values.device.type == "cpu" else values.detach().to("cpu")
            self._event = None

    def wait(self) -> np.ndarray:
        """The values as a numpy array (blocks until the copy has landed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.numpy()
