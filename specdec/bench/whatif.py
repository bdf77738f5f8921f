"""`specdec bench --synthetic SHAPE --agreements 0.5,0.7,0.8,0.9,0.95`: speedup against draft agreement.

For a shape (named, or any config.json) one synthetic target and one draft per agreement are
built (`specdec.models.synthetic`; cached in a folder, so a second study of the same shape
reuses them) and the whole `specdec bench` runs on each pair: its own report in
`OUT/agreement-A/`, with every method, the Hugging Face peers and AR, the baseline, measured in
the same run. This module adds the comparison across agreements: `report.md`, `results.json`
and `speedup_vs_agreement.png` in `OUT`.

Prompts: the pair's `prompts.jsonl`, random-token prompts (`--prompt-tokens` long), drawn
apart from the calibration contexts. Random tokens rather than a prompt set re-tokenized: the
weights are random, so no text is more natural to them than any other, and random prompts
are the contexts the agreement was calibrated on. `--prompts FILE` replaces them (a JSONL of
prompts spelled in the pair's tokens, "t17 t4021 ...").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdec.bench.report import MethodSummary, command_line, machine_info, versions
from specdec.bench.runner import BASELINE, BenchConfig, validate_config
from specdec.errors import SpecDecError
from specdec.models.loading import resolve_device, resolve_dtype
from specdec.models.synthetic import (
    PROMPTS_FILE,
    DraftInfo,
    DraftSpec,
    TargetInfo,
    TargetSpec,
    cached_draft,
    cached_target,
    load_shape,
    num_layers,
    read_record,
    target_config,
)
from specdec.parsing import parse_float_list
from specdec.paths import cache_root

DEFAULT_AGREEMENTS = "0.5,0.7,0.8,0.9,0.95"
"""--agreements default"""


def default_cache() -> Path:
    """Where built pairs are kept by default: `cache_root()`/synthetic (~/.cache/specdec/synthetic)."""
    return cache_root() / "synthetic"


def _check_agreement(value: float) -> float:
    if not 0 < value <= 1:
        raise SpecDecError(f"--agreements: {value:g} must be in (0, 1], the share of positions where the draft's argmax equals the target's")
    return value


def parse_agreements(text: str) -> list[float]:
    """'0.5,0.9' -> [0.5, 0.9], each in (0, 1], sorted."""
    return sorted(parse_float_list(text, "--agreements", _check_agreement, example=DEFAULT_AGREEMENTS))


@dataclass
class WhatIfConfig:
    """The synthetic pairs of a what-if study (the measurement itself is a BenchConfig)."""

    shape: str
    """a named shape (`specdec synth-pair --list`) or a config.json path"""
    agreements: list[float]
    """requested greedy agreements, one draft each"""
    cache: str
    """folder of the built pairs"""
    draft_layers: int = 1
    head_scale: float | None = None
    """None: auto"""
    seed: int = 0
    prompt_tokens: int = 64


@dataclass
class AgreementRun:
    """The bench at one agreement."""

    draft: DraftInfo
    summaries: list[MethodSummary]
    report: Path


@dataclass
class WhatIfOutputs:
    target: TargetInfo
    root: Path
    """the cached pair folder (target/, the drafts, prompts.jsonl, synth_pair.json)"""
    runs: list[AgreementRun]
    report: Path
    results: Path
    plot: Path


def validate_whatif(bench: BenchConfig, whatif: WhatIfConfig) -> TargetSpec:
    """Every check that needs no model, before anything is built."""
    if bench.target is not None or bench.draft is not None:
        raise SpecDecError("--synthetic builds its own target and drafts; drop --target/--draft")
    validate_config(bench)
    if not whatif.agreements:
        raise SpecDecError(f"--agreements is empty; give e.g. {DEFAULT_AGREEMENTS}")
    for a in whatif.agreements:
        _check_agreement(a)
    device = resolve_device(bench.device)
    dtype = resolve_dtype(bench.dtype, device)
    spec = TargetSpec(
        shape=whatif.shape, dtype=str(dtype).replace("torch.", ""), seed=whatif.seed, head_scale=whatif.head_scale, prompt_tokens=whatif.prompt_tokens
    )
    spec.validate()
    config, _ = target_config(load_shape(whatif.shape, flag="--synthetic"), spec.dtype)
    for a in whatif.agreements:
        DraftSpec(agreement=a, draft_layers=whatif.draft_layers).validate(num_layers(config))
    return spec


def run_whatif(bench: BenchConfig, whatif: WhatIfConfig, argv: Sequence[str] = (), log: Callable[[str], None] = print) -> WhatIfOutputs:
    """Build (or reuse) the pairs, run the bench at every agreement, write the comparison."""
    from specdec.bench import run_and_report

    spec = validate_whatif(bench, whatif)
    device = resolve_device(bench.device)
    root = cached_target(spec, Path(whatif.cache), device, log)
    out = Path(bench.out)
    runs: list[AgreementRun] = []
    for agreement in whatif.agreements:
        folder, info = cached_draft(root, DraftSpec(agreement=agreement, draft_layers=whatif.draft_layers), device, log)
        log(f"agreement {agreement:g} (achieved {info.agreement_achieved:.3f}): running the bench")
        cfg = replace(
            bench, target=str(root / "target"), draft=str(folder), prompts=bench.prompts or str(root / PROMPTS_FILE), out=str(out / f"agreement-{agreement:g}")
        )
        outputs = run_and_report(cfg, argv)
        runs.append(AgreementRun(draft=info, summaries=outputs.summaries, report=outputs.report))
    record = read_record(root)
    if record is None:
        raise SpecDecError(f"the synthetic pair in {root} disappeared during the run; run again")
    plot = plot_whatif(runs, out / "speedup_vs_agreement.png")
    report = out / "report.md"
    report.write_text(render_whatif(record.target, root, runs, bench, whatif, argv, plot), encoding="utf-8")
    results = out / "results.json"
    results.write_text(json.dumps(whatif_dict(record.target, root, runs, bench, whatif, argv), indent=1, default=str), encoding="utf-8")
    return WhatIfOutputs(target=record.target, root=root, runs=runs, report=report, results=results, plot=plot)


# ----- the comparison --------------------------------------------------------------------


def _labels(runs: Sequence[AgreementRun]) -> list[str]:
    labels: list[str] = []
    for run in runs:
        for s in run.summaries:
            if s.label not in labels:
                labels.append(s.label)
    return labels


def _cell(run: AgreementRun, label: str) -> MethodSummary | None:
    return next((s for s in run.summaries if s.label == label), None)


def first_token_acceptance(run: AgreementRun) -> float | None:
    """The first chain variant's acceptance at depth 1: the measured counterpart of the greedy agreement."""
    chain = next((s for s in run.summaries if s.method == "chain" and s.acceptance_by_depth), None)
    return chain.acceptance_by_depth[0] if chain is not None else None


def plot_whatif(runs: Sequence[AgreementRun], path: Path) -> Path:
    """Speedup over AR (left) and τ (right) against the achieved agreement, one line per method
    (Hugging Face peers dashed)."""
    from specdec.bench.plots import pyplot, save_figure

    plt = pyplot()

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs_all = [r.draft.agreement_achieved for r in runs]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, label in enumerate(lab for lab in _labels(runs) if lab != BASELINE):
        points = [(r.draft.agreement_achieved, s) for r in runs if (s := _cell(r, label)) is not None]
        peer = any(s.peer for _, s in points)
        style = {"linestyle": "--", "marker": "s"} if peer else {"marker": "o"}
        color = colors[i % len(colors)]  # the same colour for a method in both panels
        ax1.plot([x for x, _ in points], [s.speedup for _, s in points], label=label, color=color, **style)
        taus = [(x, s.tau) for x, s in points if s.tau is not None]
        if taus:
            ax2.plot([x for x, _ in taus], [t for _, t in taus], label=label, color=color, **style)
    ax1.axhline(1.0, color="grey", lw=1, ls=":", label="AR")
    ax1.set_title("speedup over AR (same run)")
    ax1.set_ylabel("speedup (x)")
    ax2.set_title("τ: tokens committed per verification step")
    for ax in (ax1, ax2):
        ax.set_xlabel("greedy agreement of the draft (achieved)")
        if xs_all:
            ax.set_xticks(xs_all, [f"{x:.2f}" for x in xs_all])
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle("Synthetic pair: what-if speedup against draft agreement")
    return save_figure(fig, path)


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _shape_line(target: TargetInfo) -> str:
    d = target.dims
    heads = f"{d.get('num_attention_heads')} query / {d.get('num_key_value_heads', d.get('num_attention_heads'))} key-value heads"
    return (
        f"`{target.shape}`" + (f" (the shape of `{target.source}`)" if target.source else "")
        + f": {target.model_type}, hidden {d.get('hidden_size')}, {d.get('num_hidden_layers')} layers, {heads}, "
        f"intermediate {d.get('intermediate_size')}, vocabulary {d.get('vocab_size')}; {target.params / 1e6:,.1f}M parameters, {target.dtype}"
    )


def render_whatif(
    target: TargetInfo, root: Path, runs: Sequence[AgreementRun], bench: BenchConfig, whatif: WhatIfConfig, argv: Sequence[str], plot: Path
) -> str:
    """report.md of the study."""
    device = str(resolve_device(bench.device))
    machine = machine_info(device)
    ver = versions()
    labels = _labels(runs)
    heads = " | ".join(f"{r.draft.agreement_requested:g}" for r in runs)
    rule = " | ".join("---:" for _ in runs)
    draft_params = runs[0].draft.params if runs else 0
    lines = [
        f"# What-if: speedup against draft agreement (synthetic `{Path(target.shape).name if '/' in target.shape else target.shape}` pair)",
        "",
        "> **Synthetic pair**: a target of this architecture and size with random weights, computing only its first layer's "
        "function at the cost of a full forward, and drafts whose greedy agreement with it is set by noise on their head "
        "(docs/synthetic-pairs.md). The text is meaningless: these figures say how fast each method would be with a draft "
        "this good on a model this size on this machine, not how good any real draft is.",
        "",
    ]
    if not device.startswith("cuda"):
        lines += [
            f"> **No GPU was measured**: every figure here comes from the {device.upper()}. On a GPU a forward's cost grows far more "
            "slowly with the tokens verified, so trees and long chains gain more there; run the same command on one to see.",
            "",
        ]
    lines += [
        f"- **Machine**: {machine['cpu']}, {machine['logical_cores']} logical cores, {machine['memory_gb']} GB RAM, torch threads "
        f"{machine['torch_threads']}, device {device}" + (f" ({machine['gpu']})" if "gpu" in machine else " (no GPU)"),
        f"- **Versions**: python {ver['python']}, torch {ver['torch']}, transformers {ver['transformers']}",
        f"- **Command**: `{command_line(argv)}`" if argv else "- **Command**: (API call)",
        f"- **Shape**: {_shape_line(target)}",
        f"- **Draft**: the target's first {whatif.draft_layers} layer(s) + embeddings + head with noise: {draft_params / 1e6:,.1f}M parameters",
        f"- **Target head**: scale {target.head_scale:.3g}{' (auto)' if target.head_scale_auto else ''}; mean top-1 probability {target.target_top1:.2f}",
        f"- **Pairs**: `{root}` (built once, reused)",
        f"- **Prompts**: `{bench.prompts or root / PROMPTS_FILE}`: {bench.num_prompts or 'all'} prompt(s)"
        + ("" if bench.prompts else f" of {target.prompt_tokens} random tokens")
        + f"; max_new_tokens {bench.max_new_tokens}, temperature {bench.temperature}, batch size {bench.batch_size}, repeats {bench.repeats}",
        "",
        "## Agreement",
        "",
        "Requested, achieved on held-out decode positions (with the saved weights), the noise σ that gives it, the draft's mean "
        "top-1 probability and, measured in the bench, the chain's acceptance of its first draft token (the same quantity on the "
        "prompts actually decoded).",
        "",
        "| requested | achieved | σ | draft top-1 | chain first-token acceptance | report |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    out = Path(bench.out)
    for r in runs:
        rel = r.report.relative_to(out) if r.report.is_relative_to(out) else r.report
        lines.append(
            f"| {r.draft.agreement_requested:g} | {r.draft.agreement_achieved:.3f} | {r.draft.noise_std:.4g} | {r.draft.draft_top1:.2f} | "
            f"{_fmt(first_token_acceptance(r), '.3f')} | [{rel}]({rel}) |"
        )
    loops = [(r, s) for r in runs if (s := _cell(r, BASELINE)) is not None and s.loop_share is not None]
    if loops:
        lines += [
            "",
            "The target's own greedy completions (AR, `--quality`) ending in a short loop (`specdec.stats.ends_in_loop`): "
            + ", ".join(f"{100 * s.loop_share:.0f}% of {s.loop_rows} at {r.draft.agreement_requested:g}" for r, s in loops)
            + "; AR's target NLL: " + ", ".join(f"{s.nll:.2f}" for _, s in loops if s.nll is not None) + " nats/token.",
        ]
    lines += ["", "## Speedup over AR", "", "Median tokens/s over AR's median tokens/s, both measured in the same run.", ""]
    lines += [f"| method | {heads} |", f"| --- | {rule} |"]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(_fmt(s.speedup if (s := _cell(r, label)) else None, ".2f", "x") for r in runs) + " |")
    lines += ["", "## Tokens per second (median)", "", f"| method | {heads} |", f"| --- | {rule} |"]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(_fmt(s.tokens_per_s_median if (s := _cell(r, label)) else None, ".1f") for r in runs) + " |")
    lines += ["", "## τ (tokens per verification step) and acceptance", "", f"| method | {heads} |", f"| --- | {rule} |"]
    for label in labels:
        cells = []
        for r in runs:
            s = _cell(r, label)
            cells.append("–" if s is None or s.tau is None else f"{s.tau:.2f} ({_fmt(s.acceptance_rate and 100 * s.acceptance_rate, '.0f', '%')})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    mismatches = [f"{s.label} at {r.draft.agreement_requested:g}" for r in runs for s in r.summaries if s.equality_mismatches and s.lossless]
    lines += [
        "",
        "## How to read it",
        "",
        "- Each column is one full `specdec bench` run on the pair with that draft (its report is linked above); AR, the HF peers "
        "and every method ran on the same prompts in the same process. AR and `hf` do not use the draft: their columns differ only "
        "by noise between runs, so the spread of `hf` (and of AR's tokens/s) across the columns shows how much a figure moves "
        "from run to run on this machine.",
        "- **achieved** agreement: the share of held-out decode positions (the target's own greedy continuations of random prompts) "
        "where the draft's argmax equals the target's. A chain's first-token acceptance measures the same thing on the bench's "
        "prompts; deeper tokens of a chain are accepted only if all before them were.",
        "- τ and acceptance: `specdec/stats.py`; acceptance counts every drafted node, so wide trees show low acceptance at any agreement.",
        "- Greedy outputs " + ("equal AR's for every lossless method." if not mismatches else f"**differ from AR** for {', '.join(mismatches)}."),
        "",
        "## Plot",
        "",
        f"![speedup against agreement]({plot.name})",
        "",
    ]
    if target.notes:
        lines += ["## Notes on the pair", ""] + [f"- {n}" for n in target.notes] + [""]
    return "\n".join(lines)


def whatif_dict(
    target: TargetInfo, root: Path, runs: Sequence[AgreementRun], bench: BenchConfig, whatif: WhatIfConfig, argv: Sequence[str]
) -> dict[str, Any]:
    """results.json of the study (each agreement's full records are in its own results.json)."""
    device = str(resolve_device(bench.device))
    return {
        "command": command_line(argv) if argv else None,
        "machine": machine_info(device),
        "versions": versions(),
        "bench": dataclasses.asdict(bench),
        "whatif": dataclasses.asdict(whatif),
        "pair_root": str(root),
        "target": dataclasses.asdict(target),
        "agreements": [
            {
                "requested": r.draft.agreement_requested,
                "draft": dataclasses.asdict(r.draft),
                "chain_first_token_acceptance": first_token_acceptance(r),
                "report": str(r.report),
                "methods": {s.label: s.to_dict() for s in r.summaries},
            }
            for r in runs
        ],
    }
