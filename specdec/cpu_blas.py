"""Intel MKL's code path for small matrix products on CPUs that are not Intel's.

PyTorch's x86 CPU builds multiply with Intel oneMKL. On an AMD CPU, MKL's default mode runs a
matrix product with 2 to 5 rows, which is what verifying a few draft tokens is (`[n, hidden] @
weight`), single-threaded and about as slowly as n one-row products: on a 2-core AMD EPYC
(torch 2.13, MKL 2024.2) a forward of the bundled target over 2 new tokens cost 1.34x one over
1 token and over 4 tokens 1.49x. In MKL's Conditional Numerical Reproducibility mode with the
automatic branch (`MKL_CBWR=AUTO`) MKL dispatches on the CPU's instruction set instead: the
same forwards cost 1.00x and 1.09x of a one-token forward, which itself got 15% faster (7.2
against 8.5 ms; `benchmarks/cpu-blas/`). Results stay float32-accurate (and become run-to-run
reproducible, which is what the mode is for).
Large products lose a little: a 2048-row product of the target's MLP shape took 15.3 against
14.6 ms (5%), which prefills of long prompts and CPU training pay; the benchmarks, prefill
included, still gained 12-43% per method.

So on x86 CPUs whose vendor is not Intel, importing specdec sets `MKL_CBWR=AUTO` unless the
environment already sets `MKL_CBWR`. MKL reads the variable at its first matrix product, so
this takes effect when specdec is imported before the process multiplies anything on the CPU
(the `specdec` command always does); it changes nothing on GPUs, on CPUs without MKL (ARM) or
on Intel CPUs, where the mode was measured to change nothing: on a 2-core Intel Xeon (Sapphire
Rapids) the target's forward cost 8.2 / 8.9 / 12.3 / 15.4 ms for 1 / 2 / 6 / 16 new tokens in
the default mode and 8.3 / 9.1 / 12.8 / 15.6 with `MKL_CBWR=AUTO`: there the slope is float32
compute on two cores, which no MKL branch removes (`benchmarks/cpu-blas/forward_cost_intel_xeon.json`). `SPECDEC_MKL_CBWR=off` leaves MKL alone; any other value
of it is used as `MKL_CBWR` on every CPU.

No torch import here: `specdec/__init__.py` calls `configure_mkl` before anything loads torch.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from pathlib import Path

MKL_VARIABLE = "MKL_CBWR"
"""MKL's Conditional Numerical Reproducibility setting (read once, at MKL's first call)"""
OVERRIDE_VARIABLE = "SPECDEC_MKL_CBWR"
"""'off' (or '0', 'no', 'false'): leave MKL as it is; any other value: use it as MKL_CBWR"""
AUTO_VALUE = "AUTO"
"""what specdec sets on non-Intel x86 CPUs: reproducibility mode, branch chosen from the CPU"""
_OFF = frozenset({"off", "0", "no", "false", "none"})
_X86 = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def cpu_vendor() -> str | None:
    """The CPU's vendor id ('GenuineIntel', 'AuthenticAMD', 'HygonGenuine', ...) on x86
    machines, None elsewhere or when it cannot be read."""
    if platform.machine().lower() not in _X86:
        return None
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    text = platform.processor()  # Windows: 'AMD64 Family 25 Model 1 Stepping 1, AuthenticAMD'
    for vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine"):
        if vendor in text:
            return vendor
    return None


def configure_mkl(environ: MutableMapping[str, str] | None = None, vendor: str | None = "detect") -> str | None:
    """Sets MKL_CBWR for this process where it makes small products faster (see the module's
    text). environ: the environment to change (os.environ); vendor: the CPU vendor id, or
    'detect' to read it. Returns the value it set, or None when it set nothing."""
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE_VARIABLE)
    if override is not None:
        if override.strip().lower() in _OFF or not override.strip():
            return None
        env[MKL_VARIABLE] = override.strip()
        return env[MKL_VARIABLE]
    if MKL_VARIABLE in env:  # the user's own choice
        return None
    found = cpu_vendor() if vendor == "detect" else vendor
    if found is None or found == "GenuineIntel":
        return None
    env[MKL_VARIABLE] = AUTO_VALUE
    return AUTO_VALUE


def mkl_mode(environ: MutableMapping[str, str] | None = None) -> str:
    """MKL_CBWR as this process sees it, or 'default' (for reports and cost-profile provenance)."""
    env = os.environ if environ is None else environ
    return env.get(MKL_VARIABLE) or "default"
