"""`specdec bench`: our methods and Hugging Face's peers, same prompts, same process, same run.

`run_and_report(config, out_dir, argv)` runs the benchmark (`runner`), summarizes it
(`report`), writes report.md, results.json and the PNG plots (`plots`). `--methods` items
and their labels: `variants`; output quality (`--quality`): `quality`; the DynaTree grid
(`specdec sweep`): `sweep`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.bench.prompts import BenchPrompt, load_prompts, resolve_prompt_source
    from specdec.bench.report import MethodSummary
    from specdec.bench.runner import DEFAULT_METHODS, BenchConfig, BenchResult, run_bench

__all__ = [
    "DEFAULT_METHODS",
    "BenchConfig",
    "BenchOutputs",
    "BenchPrompt",
    "BenchResult",
    "MethodSummary",
    "load_prompts",
    "resolve_prompt_source",
    "run_and_report",
    "run_bench",
]

_LAZY = {
    "BenchPrompt": "specdec.bench.prompts",
    "load_prompts": "specdec.bench.prompts",
    "resolve_prompt_source": "specdec.bench.prompts",
    "MethodSummary": "specdec.bench.report",
    "DEFAULT_METHODS": "specdec.bench.runner",
    "BenchConfig": "specdec.bench.runner",
    "BenchResult": "specdec.bench.runner",
    "run_bench": "specdec.bench.runner",
}
"""names imported on first use, so `specdec.bench.defaults` (the CLI's help) loads without torch"""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class BenchOutputs:
    """What a benchmark run leaves behind."""

    result: BenchResult
    summaries: list[MethodSummary]
    report: Path
    results: Path
    plots: list[Path]


def run_and_report(config: BenchConfig, argv: Sequence[str] = ()) -> BenchOutputs:
    """Run the benchmark and write its report, results.json and plots into `config.out`."""
    from specdec.bench.plots import write_plots
    from specdec.bench.report import summarize, write_outputs
    from specdec.bench.runner import run_bench

    result = run_bench(config)
    summaries = summarize(result)
    out_dir = Path(config.out)
    plots = write_plots(summaries, out_dir, mars_sweep=bool(config.mars_thetas))
    report, results = write_outputs(result, summaries, out_dir, argv, [str(p) for p in plots])
    return BenchOutputs(result=result, summaries=summaries, report=report, results=results, plots=plots)
