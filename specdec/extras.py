"""Optional dependencies: which extra installs them, and the error when one is missing.

The engine, the Python API and `specdec generate` need only the core dependencies;
`pip install 'specdec[serve]'` adds the HTTP server, `[bench]` the benchmarks' plots and
system report, `[vision]` images, `[gpu]` device maps and bitsandbytes quantization.
"""

from __future__ import annotations

import importlib.util

from specdec.errors import SpecDecError

EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
    "bench": ("matplotlib", "psutil"),
    "vision": ("PIL",),
    "gpu": ("accelerate", "bitsandbytes"),
}
"""extra -> the import names it provides (pyproject.toml's optional-dependencies)"""


def missing(*modules: str) -> list[str]:
    """The import names among `modules` that are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(module: str | None, extra: str, what: str) -> None:
    """A SpecDecError naming `pip install 'specdec[extra]'` when `module` (default: every
    module of the extra) is not installed; `what` is the feature that needs it."""
    absent = missing(module) if module else missing(*EXTRAS[extra])
    if absent:
        pip_name = {"PIL": "pillow"}
        names = ", ".join(pip_name.get(m, m) for m in absent)
        raise SpecDecError(f"{what} needs {names}, not installed here; install with pip install 'specdec[{extra}]'")
