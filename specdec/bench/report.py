"""From call records to figures: per-method summaries, report.md and results.json.

Every metric comes from `specdec.stats` (tau, acceptance_rate, speedup, upper_bound_speedup
and the GenerationStats properties); this module only aggregates over calls:
- tokens/s: the median over calls (prompt x turn x repeat) of each call's throughput, and the
  aggregate (total new tokens / total wall time);
- speedup: ratio of median tokens/s to AR's; per prompt: for each prompt (and turn), the
  ratio of its median tokens/s over repeats to AR's, then the median and IQR of those ratios;
- τ and acceptance pool every step of every call; TTFT and TPOT are medians over every request
  (row) of every call, engine efficiency over calls; the time split is summed time / summed wall time.
- per category (prompt files with a `category` field, e.g. Spec-Bench): the same medians and
  pooled τ over each category's calls, speedup against AR's median in the same category;
- quality (`--quality`): AR agreement pools every row against AR's row of the same repeat,
  prompt group and turn; NLL pools every generated token; the parse share pools code rows;
  the loop share pools every row; the relaxed share pools relaxed / accepted tokens over calls.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdec.bench.runner import BASELINE, BenchResult, CallRecord
from specdec.cpu_blas import mkl_mode
from specdec.stats import (
    acceptance_rate,
    exact_match_share,
    loop_share,
    mean_nll,
    parse_share,
    position_agreement,
    prefix_agreement,
    relaxed_share,
    speedup,
    tau,
    upper_bound_speedup,
)

LOSSY_RULES = frozenset({"mars"})
"""accept rules that may commit tokens AR would not (their AR mismatches are reported, not alarms)"""


@dataclass
class MethodSummary:
    """Every figure of one method (None = not applicable, shown as n/a)."""

    label: str
    method: str
    verify: str | None
    peer: bool
    calls: int
    new_tokens: int
    wall_s: float
    tokens_per_s_median: float
    tokens_per_s_aggregate: float
    speedup: float
    """ratio of median tokens/s to AR's median tokens/s"""
    speedup_per_prompt_median: float
    speedup_per_prompt_q1: float
    speedup_per_prompt_q3: float
    per_prompt_speedups: list[float]
    tau: float | None = None
    acceptance_rate: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    prefill_share: float | None = None
    draft_share: float | None = None
    verify_share: float | None = None
    overhead_share: float | None = None
    engine_efficiency: float | None = None
    draft_ms_per_step: float | None = None
    verify_ms_per_step: float | None = None
    tau_max: float | None = None
    """mean over steps of tree depth + 1"""
    upper_bound_speedup: float | None = None
    rss_mb: float = 0.0
    """largest process RSS seen right after this method's calls (process-wide: includes every model loaded)"""
    gpu_peak_mb: float | None = None
    """CUDA only: the largest peak of torch-allocated GPU memory during one of this method's calls"""
    lossless: bool = True
    """False for a lossy accept rule (mars): outputs may legitimately differ from AR"""
    relaxed_tokens: int | None = None
    """tokens a lossy rule accepted by relaxation (mars), summed over calls"""
    equality_compared: int | None = None
    equality_mismatches: int | None = None
    """greedy runs: generated rows whose tokens differ from AR's on the same prompt, turn and repeat"""
    equality_ties: int | None = None
    """greedy runs: of those, rows whose first divergence is a numerical tie (`specdec.bench.divergence`)"""
    ops_per_step: float | None = None
    """torch ops per decoding step outside model forwards, views excluded (`specdec.hostwork`)"""
    ops_all_per_step: float | None = None
    """the same, views included"""
    host_reads_per_step: float | None = None
    """device-to-host value reads per decoding step outside model forwards"""
    host_kb_per_step: float | None = None
    """what those reads copied per decoding step, in KB (1000 bytes)"""
    policy_state: dict[str, Any] | None = None
    """an adaptive policy's learned state after the timed calls (`BenchResult.policy_states`)"""
    tau_histogram: dict[int, int] = field(default_factory=dict)
    """accepted_len + 1 -> steps"""
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    """the policy options the variant ran with (global flags merged with its item's own)"""
    rule_options: dict[str, Any] = field(default_factory=dict)
    base: str = ""
    """the label without the accept rule"""
    theta: float | None = None
    """the effective MARS theta (mars variants only)"""
    drafted_per_step: float | None = None
    """drafted tokens (tree nodes) per verification step, pooled"""
    root_only_share: float | None = None
    """share of row-steps whose tree was the root alone (`GenerationStats.root_only_steps`), pooled"""
    relaxed_share: float | None = None
    """`specdec.stats.relaxed_share`: relaxed / accepted draft tokens (mars; 0 for strict rules)"""
    ar_prefix_agreement: float | None = None
    """quality: `specdec.stats.prefix_agreement` against AR (the MARS paper's precision)"""
    ar_token_agreement: float | None = None
    """quality: `specdec.stats.position_agreement` against AR"""
    exact_match: float | None = None
    """quality: `specdec.stats.exact_match_share` against AR"""
    nll: float | None = None
    """quality: `specdec.stats.mean_nll` of every generated token under the target"""
    nll_delta: float | None = None
    """quality: nll - AR's nll"""
    parse_share: float | None = None
    """quality: `specdec.stats.parse_share` over code prompts (None without any)"""
    parse_rows: int = 0
    """quality: code completions checked"""
    loop_share: float | None = None
    """quality: `specdec.stats.loop_share`, completions ending in a short loop (degeneracy)"""
    loop_rows: int = 0
    """quality: completions checked for loops"""

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [acceptance_rate(a, d) for a, d in zip(self.accepted_by_depth, self.drafted_by_depth, strict=True)]

    @property
    def matches_ar(self) -> bool | None:
        return None if self.equality_mismatches is None else self.equality_mismatches == 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "acceptance_by_depth": self.acceptance_by_depth, "matches_ar": self.matches_ar}


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    q1, q3 = np.percentile(np.asarray(values, dtype=float), [25, 75])
    return float(q1), float(q3)


def _unit_medians(records: Sequence[CallRecord]) -> dict[tuple[int, int], float]:
    """(group, turn) -> median tokens/s over repeats."""
    by_unit: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in records:
        by_unit[r.unit].append(r.tokens_per_s)
    return {u: _median(v) for u, v in by_unit.items()}


def _per_step_s(records: Sequence[CallRecord]) -> tuple[float, float]:
    """Median over calls of each call's mean drafting and verification time per step.

    Averaging within a call and taking the median across calls matches how throughput is
    summarized (per call, then median), so the upper bound is comparable with the speedup.
    """
    calls = [r.stats for r in records if r.stats is not None and r.stats.steps > 0]
    return _median([st.draft_s / st.steps for st in calls]), _median([st.verify_s / st.steps for st in calls])


def _ar_token_s(ar_records: Sequence[CallRecord]) -> float:
    """AR's median time per token: one AR decode step (draft + verify) commits one token per row."""
    draft_s, verify_s = _per_step_s(ar_records)
    return draft_s + verify_s


def summarize(result: BenchResult) -> list[MethodSummary]:
    """One summary per method, in the order they were asked for."""
    by_label: dict[str, list[CallRecord]] = defaultdict(list)
    for r in result.records:
        by_label[r.label].append(r)
    ar_records = by_label[BASELINE]
    ar_median = _median([r.tokens_per_s for r in ar_records])
    ar_units = _unit_medians(ar_records)
    ar_outputs = {(r.repeat, r.group, r.turn): r.outputs for r in ar_records}
    ar_token_s = _ar_token_s(ar_records)
    greedy = result.config.temperature == 0
    quality = result.config.quality or bool(result.config.mars_thetas)
    summaries = []
    for v in result.variants:
        records = by_label.get(v.label, [])
        if not records:
            continue
        tps = [r.tokens_per_s for r in records]
        new_tokens = sum(r.new_tokens for r in records)
        wall = sum(r.wall_s for r in records)
        units = _unit_medians(records)
        ratios = [speedup(units[u], ar_units[u]) for u in sorted(units) if u in ar_units]
        q1, q3 = _quartiles(ratios)
        s = MethodSummary(
            label=v.label,
            method=v.method,
            verify=v.verify,
            peer=v.peer,
            calls=len(records),
            new_tokens=new_tokens,
            wall_s=wall,
            tokens_per_s_median=_median(tps),
            tokens_per_s_aggregate=new_tokens / wall if wall > 0 else 0.0,
            speedup=speedup(_median(tps), ar_median),
            speedup_per_prompt_median=_median(ratios),
            speedup_per_prompt_q1=q1,
            speedup_per_prompt_q3=q3,
            per_prompt_speedups=ratios,
            rss_mb=max(r.rss_bytes for r in records) / 2**20,
            gpu_peak_mb=max(r.gpu_peak_bytes for r in records) / 2**20 if all(r.gpu_peak_bytes is not None for r in records) else None,
            lossless=v.verify not in LOSSY_RULES,
            options=dict(v.options),
            rule_options=dict(v.rule_options),
            base=v.base or v.label,
            theta=v.theta,
        )
        if quality:
            _add_quality(s, records, ar_outputs)
        if greedy:
            compared = mismatches = ties = 0
            for r in records:
                reference = ar_outputs.get((r.repeat, r.group, r.turn))
                if reference is None:
                    continue
                for row, (out, ref) in enumerate(zip(r.outputs, reference, strict=True)):
                    compared += 1
                    mismatches += out != ref
                    div = r.divergences[row] if r.divergences is not None else None
                    ties += div is not None and div["kind"] == "numerical tie"
            s.equality_compared, s.equality_mismatches, s.equality_ties = compared, mismatches, ties
        s.policy_state = result.policy_states.get(v.label)
        work = result.host_work.get(v.label)
        if work is not None:
            s.ops_per_step, s.ops_all_per_step, s.host_reads_per_step = work["ops"], work["ops_all"], work["host_reads"]
            s.host_kb_per_step = work["host_bytes"] / 1000 if "host_bytes" in work else None  # (results.json of older runs lack it)
        stats = [r.stats for r in records if r.stats is not None]
        if stats:
            lens = [a for st in stats for a in st.accepted_lens]
            s.tau = tau(lens)
            s.root_only_share = sum(st.root_only_steps for st in stats) / len(lens) if lens else None
            s.relaxed_tokens = sum(st.relaxed_tokens for st in stats)
            drafted = sum(st.drafted_tokens for st in stats)
            s.acceptance_rate = acceptance_rate(sum(st.accepted_tokens for st in stats), drafted) if drafted else None
            steps = sum(st.steps for st in stats)
            s.drafted_per_step = drafted / steps if steps else None
            s.relaxed_share = relaxed_share(s.relaxed_tokens, sum(st.accepted_tokens for st in stats))
            # per request (row): its time to first token from the call's start and its own time per
            # token after that, medians over every row of every call
            row_ttft = [x for r in records for x in r.row_ttft_s]
            row_tpot = [x for r in records for x in r.row_tpot_s]
            s.ttft_ms = _median(row_ttft) * 1e3 if row_ttft else None
            s.tpot_ms = _median(row_tpot) * 1e3 if row_tpot else None
            total = sum(st.wall_s for st in stats)
            if total > 0:
                s.prefill_share = sum(st.prefill_s for st in stats) / total
                s.draft_share = sum(st.draft_s for st in stats) / total
                s.verify_share = sum(st.verify_s for st in stats) / total
                s.overhead_share = sum(st.overhead_s for st in stats) / total
            efficiencies = [e for e in (st.engine_efficiency for st in stats) if e is not None]
            s.engine_efficiency = _median(efficiencies) if efficiencies else None  # None: forwards not timed (CUDA by default)
            s.tau_histogram = dict(sorted(Counter(a + 1 for a in lens).items()))
            depth = max((len(st.drafted_by_depth) for st in stats), default=0)
            s.drafted_by_depth = [sum(st.drafted_by_depth[d] for st in stats if d < len(st.drafted_by_depth)) for d in range(depth)]
            s.accepted_by_depth = [sum(st.accepted_by_depth[d] for st in stats if d < len(st.accepted_by_depth)) for d in range(depth)]
            tau_max_steps = [x for r in records for x in r.step_tau_max]
            if tau_max_steps:
                draft_step_s, verify_step_s = _per_step_s(records)
                s.draft_ms_per_step = draft_step_s * 1e3
                s.verify_ms_per_step = verify_step_s * 1e3
                s.tau_max = statistics.fmean(tau_max_steps)
                if v.label != BASELINE:
                    s.upper_bound_speedup = upper_bound_speedup(s.tau_max, ar_token_s, draft_step_s, verify_step_s)
        summaries.append(s)
    ar = next((s for s in summaries if s.label == BASELINE), None)
    if ar is not None and ar.nll is not None:
        for s in summaries:
            if s.nll is not None:
                s.nll_delta = s.nll - ar.nll
    return summaries


def _add_quality(s: MethodSummary, records: Sequence[CallRecord], ar_outputs: dict[tuple[int, int, int], list[list[int]]]) -> None:
    """AR agreement (rows against AR's rows of the same repeat, group and turn), NLL and parse share."""
    outputs: list[list[int]] = []
    references: list[list[int]] = []
    for r in records:
        reference = ar_outputs.get((r.repeat, r.group, r.turn))
        if reference is not None:
            outputs.extend(r.outputs)
            references.extend(reference)
    if outputs:
        s.ar_prefix_agreement = prefix_agreement(outputs, references)
        s.ar_token_agreement = position_agreement(outputs, references)
        s.exact_match = exact_match_share(outputs, references)
    if all(r.token_logprobs is not None for r in records):
        s.nll = mean_nll([lp for r in records for row in r.token_logprobs or [] for lp in row])
    flags = [f for r in records for f in (r.parses or []) if f is not None]
    s.parse_share, s.parse_rows = parse_share(flags), len(flags)
    loops = [f for r in records for f in (r.loops or [])]
    s.loop_share, s.loop_rows = loop_share(loops), len(loops)


# ----- per category --------------------------------------------------------------------

MIXED_CATEGORY = "(mixed batch)"
"""the category of a call whose rows (batch size > 1) come from different categories"""
NO_CATEGORY = "(none)"
"""the category of a prompt without one, in a file where others have one"""


@dataclass
class CategorySummary:
    """One method's figures over one prompt category's calls."""

    category: str
    label: str
    prompts: int
    """prompts of the category in the run"""
    calls: int
    tokens_per_s_median: float
    speedup: float
    """median tokens/s over the category's calls / AR's median over the same category"""
    tau: float | None = None
    acceptance_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def categories(result: BenchResult) -> dict[str, int]:
    """Category -> prompts, in the order of the prompt file; empty when no prompt has a category."""
    if not any(p.category for p in result.prompts):
        return {}
    return dict(Counter(p.category or NO_CATEGORY for p in result.prompts))


def record_category(record: CallRecord, by_prompt: dict[str, str]) -> str:
    """The category of a call: its rows' one category, or MIXED_CATEGORY."""
    found = {by_prompt.get(pid, NO_CATEGORY) for pid in record.prompt_ids}
    return found.pop() if len(found) == 1 else MIXED_CATEGORY


def summarize_categories(result: BenchResult) -> list[CategorySummary]:
    """Per category and method (categories in file order, methods as asked): median tokens/s,
    speedup over AR in the same category, pooled τ and acceptance. Empty without categories."""
    counts = categories(result)
    if not counts:
        return []
    by_prompt = {p.id: p.category or NO_CATEGORY for p in result.prompts}
    grouped: dict[tuple[str, str], list[CallRecord]] = defaultdict(list)
    for r in result.records:
        grouped[(record_category(r, by_prompt), r.label)].append(r)
    names = list(counts) + ([MIXED_CATEGORY] if any(c == MIXED_CATEGORY for c, _ in grouped) else [])
    out = []
    for category in names:
        ar_median = _median([r.tokens_per_s for r in grouped.get((category, BASELINE), [])])
        for v in result.variants:
            records = grouped.get((category, v.label), [])
            if not records:
                continue
            median = _median([r.tokens_per_s for r in records])
            s = CategorySummary(
                category=category, label=v.label, prompts=counts.get(category, 0), calls=len(records),
                tokens_per_s_median=median, speedup=speedup(median, ar_median) if ar_median > 0 else 0.0,
            )
            stats = [r.stats for r in records if r.stats is not None]
            if stats:
                s.tau = tau([a for st in stats for a in st.accepted_lens])
                drafted = sum(st.drafted_tokens for st in stats)
                s.acceptance_rate = acceptance_rate(sum(st.accepted_tokens for st in stats), drafted) if drafted else None
            out.append(s)
    return out


def category_lines(rows: Sequence[CategorySummary]) -> list[str]:
    """The `## Per category` table (one row per category and method)."""
    lines = ["| category | prompts | method | tok/s (median) | speedup | τ | acceptance |", "|---|---:|---|---:|---:|---:|---:|"]
    for c in rows:
        lines.append(
            f"| {c.category} | {c.prompts} | {c.label} | {c.tokens_per_s_median:.1f} | {c.speedup:.2f}x | {_fmt(c.tau)} | {_pct(c.acceptance_rate)} |"
        )
    return lines


# ----- machine and versions ------------------------------------------------------------


def machine_info(device: str) -> dict[str, Any]:
    """CPU model (from /proc/cpuinfo), core counts, torch threads, MKL's numerical mode
    (`specdec.cpu_blas`), memory, GPU name if any."""
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "torch_threads": torch.get_num_threads(),
        "mkl_cbwr": mkl_mode(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def versions() -> dict[str, str]:
    import torch
    import transformers

    import specdec

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec": getattr(specdec, "__version__", "unknown"),
    }


def command_line(argv: Sequence[str]) -> str:
    """The exact command, shell-quoted."""
    return "specdec " + " ".join(shlex.quote(a) for a in argv)


# ----- text ----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _verify(s: MethodSummary) -> str:
    """The accept rule, with theta for mars."""
    if s.verify is None:
        return "n/a"
    return f"{s.verify} θ={s.theta:g}" if s.theta is not None else s.verify


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def quality_lines(summaries: Sequence[MethodSummary]) -> list[str]:
    """The `## Quality` table (one row per method)."""
    lines = [
        "| method | verify | speedup | τ | relaxed share | AR prefix agreement | AR token agreement | exact match | NLL | Δ NLL vs AR | parses | loops |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        parses = "n/a" if s.parse_share is None else f"{100 * s.parse_share:.0f}% of {s.parse_rows}"
        loops = "n/a" if s.loop_share is None else f"{100 * s.loop_share:.0f}% of {s.loop_rows}"
        lines.append(
            f"| {s.label} | {_verify(s)} | {s.speedup:.2f}x | {_fmt(s.tau)} | {_pct1(s.relaxed_share)} | {_pct1(s.ar_prefix_agreement)} | "
            f"{_pct1(s.ar_token_agreement)} | {_pct1(s.exact_match)} | {_fmt(s.nll, '.3f')} | {_signed(s.nll_delta)} | {parses} | {loops} |"
        )
    return lines


def _pct1(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _equality(s: MethodSummary) -> str:
    if s.equality_mismatches is None:
        return "n/a"
    if s.label == BASELINE:
        return "baseline"
    if not s.lossless:
        return f"lossy: {s.equality_mismatches}/{s.equality_compared} differ"
    if s.equality_mismatches == 0:
        return "yes"
    ties = s.equality_ties or 0
    if ties == s.equality_mismatches:
        return f"yes up to ties: {ties}/{s.equality_compared} differ at a numerical tie"
    return f"NO: {s.equality_mismatches}/{s.equality_compared} differ ({ties} at a numerical tie, {s.equality_mismatches - ties} mismatch)"


def verdict(summaries: Sequence[MethodSummary]) -> str:
    """The plain sentence: the fastest method and by how much; the ones slower than AR."""
    ar = next((s for s in summaries if s.label == BASELINE), None)
    others = [s for s in summaries if s.label != BASELINE]
    if ar is None or not others:
        return "Only AR was measured; there is nothing to compare."
    best = max(others, key=lambda s: s.speedup)
    slower = sorted((s for s in others if s.speedup < 1.0), key=lambda s: s.speedup)
    if best.speedup > 1.0:
        text = (
            f"The fastest method is **{best.label}**: {best.speedup:.2f}x AR "
            f"({best.tokens_per_s_median:.1f} vs {ar.tokens_per_s_median:.1f} median tokens/s)."
        )
    else:
        text = f"No method beat AR ({ar.tokens_per_s_median:.1f} median tokens/s); the closest is **{best.label}** at {best.speedup:.2f}x."
    if slower:
        text += (
            " Slower than AR: "
            + ", ".join(
                f"{s.label} ({s.speedup:.2f}x{', within the per-prompt spread of 1x' if s.speedup_per_prompt_q3 >= 1.0 else ''})"
                for s in slower
            )
            + "."
        )
    else:
        text += " No method is slower than AR."
    bad = [s.label for s in summaries if s.equality_mismatches and s.lossless and s.equality_mismatches != (s.equality_ties or 0)]
    if bad:
        text += f" **Outputs differ from AR** for {', '.join(bad)} (a greedy, lossless method must match AR exactly)."
    return text


def render_markdown(result: BenchResult, summaries: Sequence[MethodSummary], argv: Sequence[str], plots: Sequence[str]) -> str:
    """report.md: machine, versions, command, config, the tables, the verdict."""
    cfg = result.config
    machine = machine_info(result.device)
    ver = versions()
    turns = sum(len(p.turns) for p in result.prompts)
    lines = [
        "# specdec bench",
        "",
        f"- **Machine**: {machine['cpu']}, {machine['logical_cores']} logical cores ({machine['physical_cores']} physical), "
        f"{machine['memory_gb']} GB RAM, torch threads {machine['torch_threads']}, MKL_CBWR {machine.get('mkl_cbwr', 'not recorded')}, device {result.device}"
        + (f" ({machine['gpu']})" if "gpu" in machine else ""),
        f"- **Versions**: python {ver['python']}, torch {ver['torch']}, transformers {ver['transformers']}, specdec {ver['specdec']}",
        f"- **Command**: `{command_line(argv)}`",
        f"- **Models**: target `{result.target_path}`, draft `{result.draft_path or 'none'}`, dtype {result.dtype}, context {result.max_context}",
        f"- **Prompts**: `{result.prompt_file}`: {len(result.prompts)} prompt(s), {turns} turn(s) in all",
        f"- **Config**: max_new_tokens {cfg.max_new_tokens}, temperature {cfg.temperature}, top_p {cfg.top_p}, top_k {cfg.top_k}, "
        f"batch size {cfg.batch_size}"
        + (" (`--schedule rolling`: one rolling batch over every prompt, a finished row's place going to the next)" if cfg.schedule == "rolling" else "")
        + f", repeats {cfg.repeats} (medians; warm-up call per method; method order shuffled per prompt, seed {cfg.seed}), "
        f"verify {', '.join(cfg.verify)}" + (f", max_draft_rows {cfg.max_draft_rows} (steps with more active rows draft nothing)" if cfg.max_draft_rows is not None else ""),
    ]
    options = {m: o for m, o in cfg.method_options.items() if o}
    if options:
        lines.append(
            "- **Method options** (global flags; an item's own options override them): "
            + "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in o.items()) for m, o in options.items())
        )
    if cfg.chat:
        lines.append(
            "- **Chat**: every prompt sent through the tokenizer's chat template (each turn a user message)"
            + (f", system message {cfg.system!r}" if cfg.system is not None else "")
        )
    if cfg.mars_thetas:
        lines.append(f"- **MARS θ sweep**: every method strictly and with mars at θ = {', '.join(f'{t:g}' for t in cfg.mars_thetas)}")
    quality = cfg.quality or bool(cfg.mars_thetas)
    lines.append(f"- **Bench wall time**: {result.wall_s:.1f} s")
    lines += ["", "## Speed", ""]
    lines.append(
        "| method | verify | tok/s (median) | tok/s (aggregate) | speedup | per-prompt speedup median [IQR] | upper bound | τ | acceptance | TTFT ms | TPOT ms | = AR |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for s in summaries:
        lines.append(
            f"| {s.label} | {_verify(s)} | {s.tokens_per_s_median:.1f} | {s.tokens_per_s_aggregate:.1f} | {s.speedup:.2f}x | "
            f"{s.speedup_per_prompt_median:.2f}x [{s.speedup_per_prompt_q1:.2f}, {s.speedup_per_prompt_q3:.2f}] | "
            f"{_fmt(s.upper_bound_speedup, '.2f', 'x')} | {_fmt(s.tau)} | {_pct(s.acceptance_rate)} | {_fmt(s.ttft_ms, '.1f')} | "
            f"{_fmt(s.tpot_ms, '.2f')} | {_equality(s)} |"
        )
    lines += ["", "## Where the time goes", ""]
    lines.append(
        "| method | prefill | draft | verify | overhead | engine efficiency | draft ms/step | verify ms/step | τ max | ops/step | host reads/step | host KB/step | RSS MB | GPU peak MB |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        lines.append(
            f"| {s.label} | {_pct(s.prefill_share)} | {_pct(s.draft_share)} | {_pct(s.verify_share)} | {_pct(s.overhead_share)} | "
            f"{_pct(s.engine_efficiency)} | {_fmt(s.draft_ms_per_step, '.2f')} | {_fmt(s.verify_ms_per_step, '.2f')} | {_fmt(s.tau_max)} | {_fmt(s.ops_per_step, '.0f')} | {_fmt(s.host_reads_per_step, '.1f')} | {_fmt(s.host_kb_per_step, '.1f')} | {s.rss_mb:.0f} | {_fmt(s.gpu_peak_mb, '.0f')} |"
        )
    per_category = summarize_categories(result)
    if per_category:
        lines += ["", "## Per category", "", "Figures over each category's calls (speedup: against AR in the same category)."]
        if any(c.category == MIXED_CATEGORY for c in per_category):
            lines.append(f"Calls whose batch mixes categories count under {MIXED_CATEGORY}; run with --batch-size 1 for exact categories.")
        lines += [""] + category_lines(per_category)
    if quality:
        lines += ["", "## Quality", ""] + quality_lines(summaries)
    lines += ["", "## Verdict", "", verdict(summaries), ""]
    lines += [
        "## How to read it",
        "",
        "- **speedup**: median tokens/s over every call (prompt x turn x repeat) divided by AR's, all measured in this run. "
        "**per-prompt**: each prompt's median over repeats divided by AR's on the same prompt; median and interquartile range.",
        "- **upper bound**: the speedup if every drafted path were accepted fully: τ max x AR's time per token / (draft + verify time per step); "
        "τ max is the tree depth + 1 (mean over steps); per-step times are each call's mean, median over calls. "
        "It leaves out prefill and bookkeeping, so a measured speedup can exceed it when AR's own overhead is large.",
        "- **τ**: tokens committed per verification step; **acceptance**: accepted / drafted tokens (every tree node counts).",
        "- **TTFT, TPOT**: per request (prompt row): the time from the call's start to its first token (a rolling call's wait for a free row "
        "included) and its own time per token after the first (one stream's latency, not the batch's aggregate); medians over every row of every call.",
        "- **prefill/draft/verify/overhead**: share of wall time; **engine efficiency**: share of wall time inside model forwards (n/a on CUDA unless SPECDEC_TIME_FORWARDS=1: timing every forward slows decoding there).",
        "- **ops/step, host reads/step, host KB/step**: per decoding step, outside model forwards: torch ops that do work (views excluded; each is a "
        "kernel launch on a GPU), device-to-host value reads (`.item()`, `.tolist()`, `bool(t)`, ...; each a full sync on a GPU) "
        "and the bytes they copy (over the bus on a GPU), "
        "counted on extra untimed calls on the first prompt groups, until 16 steps are seen (`specdec.hostwork`).",
        "- **= AR**: greedy outputs equal AR's token for token; where one differs, its first divergence is classified "
        "(`specdec.bench.divergence`): a *numerical tie* when AR's and the method's tokens have logits within a few units in the "
        "last place of the run's dtype (either is the target's greedy choice to the precision it computes in), else a *mismatch*.",
        "- **RSS**: process-wide resident memory right after the method's calls (all loaded models included).",
        "- **= AR**: greedy only: every output equals plain AR's on the same prompt; n/a when sampling; "
        "a lossy rule (mars) may differ by design.",
        "- **labels**: `method[options]` for a `--methods` item with its own options, `/rule[options]` when the accept rule is shown; "
        "the options a variant ran with are in results.json (`methods.<label>.options`).",
        "- Hugging Face peers (hf, hf-assisted, hf-lookup) report no TTFT, τ or time split (n/a). They run with HF's defaults "
        "(hf-lookup: prompt_lookup_num_tokens=10); hf-assisted's adaptive draft length restarts from its initial value on every call. "
        "At batch sizes above 1, hf decodes each group as one left-padded generate() call.",
        "",
    ]
    if quality:
        lines += [
            "Quality (definitions in `specdec/stats.py`; every row is compared with AR's row of the same prompt, turn and repeat):",
            "",
            "- **relaxed share**: draft tokens accepted only by the lossy rule's relaxation / all accepted draft tokens.",
            "- **AR prefix agreement** (the MARS paper's precision): tokens equal to AR's up to the first divergence / "
            "max(len, AR's len), pooled over rows; **AR token agreement**: tokens equal to AR's at the same position anywhere; "
            "**exact match**: share of rows identical to AR's.",
            "- **NLL**: the target's mean negative log-likelihood (nats/token, raw logits: temperature 1, no top-k/top-p) of the "
            "generated tokens given the fed context, pooled over tokens; lower = more target-like. **Δ NLL vs AR**: minus AR's.",
            "- **parses**: share of completions of code prompts for which prompt + completion, cut at the last complete line "
            "(unless it ended with EOS), passes `ast.parse` and the kept completion holds code (a completion of blank lines and "
            "`#` comments only does not count).",
            "- **loops** (degeneracy): share of completions (EOS dropped) whose last half is one unit of at most 4 tokens repeated.",
            "- At temperature > 0 every method samples, so even lossless methods differ from AR's sample: compare a mars variant "
            "with its strict variant (same method, sampling), not with 100%.",
            "",
        ]
    if result.cost_profiles:
        lines += ["## Cost profiles", "", "Where each cost-aware method's forward-cost table came from (ready before the warm-up and every timed call):", ""]
        lines += [f"- {label}: {source['text']}" for label, source in result.cost_profiles.items()] + [""]
    states = [line for s in summaries if s.policy_state for line in [policy_state_line(s.label, s.policy_state)] if line]
    if states:
        lines += ["## Adaptive state after the timed calls", "", "What each adaptive method had learned (whole state: results.json `policy_state`):", ""]
        lines += states + [""]
    notes = list(result.notes) + root_only_notes(summaries)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def policy_state_line(label: str, state: dict[str, Any]) -> str:
    """One markdown bullet of an adaptive policy's state: DynaTree's adapted D_0, tau_h, rho_deep
    and history moves; CAST's plain-vs-drafted ms per token by batch bucket and its learned
    overheads; '' for a state of another shape."""
    if "d0" in state:
        ratio = state.get("last_window_ratio")
        last = f", last full window accepted / predicted {ratio:.2f}" if isinstance(ratio, (int, float)) else ""
        return (
            f"- {label}: D_0 {state['d0']}, tau_h {state['tau_high']:.2f}, rho_deep {state['rho_deep']:.2f} after "
            f"{state['adjustments']} history move(s){last}"
        )
    if "plain_vs_drafted" in state:
        buckets = []
        for bucket, t in state["plain_vs_drafted"].items():
            drafted, plain = t.get("drafted_ms_per_token"), t.get("plain_ms_per_token")
            fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
            buckets.append(f"B~{bucket}: drafted {fmt(drafted)} / plain {fmt(plain)} ms per token")
        overheads = ", ".join(f"{k} {v:+.2f}" for k, v in state.get("overheads_ms", {}).items())
        return f"- {label}: {'; '.join(buckets) or 'no timed steps'}; learned overheads (ms): {overheads}"
    return ""


ROOT_ONLY_NOTE = 0.05
"""a drafting method gets a note when at least this share of its row-steps verified the root alone"""


def root_only_notes(summaries: Sequence[MethodSummary]) -> list[str]:
    """One line per drafting method that often verified its root alone: its τ averages those
    one-token steps in (CAST's plain steps are chosen because drafting was slower there)."""
    out = []
    for s in summaries:
        if s.method == BASELINE or s.peer or s.root_only_share is None or s.root_only_share < ROOT_ONLY_NOTE:
            continue
        out.append(
            f"{s.label}: {s.root_only_share:.0%} of its steps (per row) verified the root alone, nothing drafted "
            "(a plain step, a row's last token, or a tree cut to the root); τ counts each as a one-token step"
        )
    return out


def results_dict(result: BenchResult, summaries: Sequence[MethodSummary], argv: Sequence[str], plots: Sequence[str]) -> dict[str, Any]:
    """Everything, for results.json."""
    return {
        "command": command_line(argv),
        "argv": list(argv),
        "config": dataclasses.asdict(result.config),
        "machine": machine_info(result.device),
        "versions": versions(),
        "models": {
            "target": result.target_path,
            "draft": result.draft_path,
            "device": result.device,
            "dtype": result.dtype,
            "max_context": result.max_context,
        },
        "prompt_file": result.prompt_file,
        "prompts": [{"id": p.id, "turns": len(p.turns), "reference": p.reference, "category": p.category} for p in result.prompts],
        "baseline": BASELINE,
        "methods": {s.label: s.to_dict() for s in summaries},
        "categories": _categories_dict(summarize_categories(result)),
        "verdict": verdict(summaries),
        "notes": list(result.notes) + root_only_notes(summaries),
        "cost_profiles": result.cost_profiles,
        "plots": [Path(p).name for p in plots],
        "bench_wall_s": result.wall_s,
        "records": [r.to_dict() for r in result.records],
    }


def _categories_dict(rows: Sequence[CategorySummary]) -> dict[str, dict[str, dict[str, Any]]]:
    """results.json's `categories`: category -> method label -> figures (empty without categories)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for c in rows:
        out.setdefault(c.category, {})[c.label] = {k: v for k, v in c.to_dict().items() if k not in ("category", "label")}
    return out


def write_outputs(
    result: BenchResult, summaries: Sequence[MethodSummary], out_dir: Path, argv: Sequence[str], plots: Sequence[str]
) -> tuple[Path, Path]:
    """Write report.md and results.json into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "report.md"
    report.write_text(render_markdown(result, summaries, argv, plots), encoding="utf-8")
    results = out_dir / "results.json"
    results.write_text(json.dumps(results_dict(result, summaries, argv, plots), indent=1, default=str), encoding="utf-8")
    return report, results


def print_summary(summaries: Sequence[MethodSummary], file: Any = None) -> None:
    """A compact table on the terminal."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    quality = any(s.nll is not None or s.ar_prefix_agreement is not None for s in summaries)
    table = Table(title="specdec bench")
    columns = ["method", "tok/s", "speedup", "τ", "acceptance", "= AR"] + (["AR prefix", "NLL", "parses", "loops"] if quality else [])
    for col in columns:
        table.add_column(col, justify="left" if col == "method" else "right")
    for s in summaries:
        row = [escape(s.label), f"{s.tokens_per_s_median:.1f}", f"{s.speedup:.2f}x", _fmt(s.tau), _pct(s.acceptance_rate), _equality(s)]
        if quality:
            row += [_pct1(s.ar_prefix_agreement), _fmt(s.nll, ".3f"), _pct(s.parse_share), _pct(s.loop_share)]
        table.add_row(*row)
    Console(file=file if file is not None else sys.stdout).print(table)  # sys.stdout read at call time (it may be replaced)
