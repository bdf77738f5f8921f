"""`specdec bench-tabed`: block efficiency of drafting views and TABED ensembles per scenario.

For each scenario prompt set (first turn, second turn, OOD) and each drafting
configuration (single views M, T, C, P; static and random ensembles; TABED over M,T and
over M,T,C,P; window and distance ablations), every prompt is decoded greedily (batch 1)
with a chain of gamma draft tokens and with trees of width d (EAGLE-2-style: depth gamma,
top-d expansion, d * gamma nodes). Reported per cell: block efficiency tau (tokens per
verification step, as in stats.py), the estimated walltime speedup of TABED's Eq. (1)
tau / (gamma * T_q/T_p + 1) with T_q/T_p measured here for a batch of m draft rows, and
the measured tokens/s and speedup over plain AR decoding of the same prompts. Every
greedy output is checked against AR's.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts
from specdec.bench.report import machine_info, versions
from specdec.drafting.builder import check_tree_nodes
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.models.runner import ModelRunner
from specdec.multimodal.inputs import MultimodalPrompt
from specdec.multimodal.scenes import SCENARIOS
from specdec.multimodal.views import PromptView
from specdec.sources.ensemble import EnsembleConfig, EnsembleDraftSource, EnsemblePrior, estimated_speedup
from specdec.sources.model import ModelDraftSource
from specdec.stats import tau
from specdec.verification import GreedyRule


@dataclass(frozen=True)
class DraftConfig:
    """One drafting configuration: views and how they are weighted."""

    label: str
    views: tuple[str, ...]
    ensemble: dict[str, Any] = field(default_factory=dict)
    """EnsembleConfig fields (ignored for a single view)"""


MAIN_CONFIGS = (
    DraftConfig("M", ("M",)),
    DraftConfig("T", ("T",)),
    DraftConfig("C", ("C",)),
    DraftConfig("P", ("P",)),
    DraftConfig("Static-MT", ("M", "T"), {"policy": "static"}),
    DraftConfig("Random-MT", ("M", "T"), {"policy": "random"}),
    DraftConfig("TABED-MT", ("M", "T"), {"policy": "grid", "distance": "kl"}),
    DraftConfig("TABED-MTCP", ("M", "T", "C", "P"), {"policy": "softmax", "distance": "kl"}),
)
ABLATION_CONFIGS = (
    DraftConfig("TABED-MT h=1", ("M", "T"), {"policy": "grid", "window": 1}),
    DraftConfig("TABED-MT h=4", ("M", "T"), {"policy": "grid", "window": 4}),
    DraftConfig("TABED-MT h=16", ("M", "T"), {"policy": "grid", "window": 16}),
    DraftConfig("TABED-MT TV", ("M", "T"), {"policy": "grid", "distance": "tv"}),
    DraftConfig("TABED-MT hard", ("M", "T"), {"policy": "grid", "distance": "hard"}),
    DraftConfig("TABED-MTCP grid", ("M", "T", "C", "P"), {"policy": "grid"}),
    DraftConfig("TABED-MT no prior", ("M", "T"), {"policy": "grid", "prior": False}),
    DraftConfig("TABED-MTCP no prior", ("M", "T", "C", "P"), {"policy": "softmax", "prior": False}),
)
TREE_CONFIGS = ("M", "T", "TABED-MT")
"""the configurations also run with tree verification"""


@dataclass
class Cell:
    """One (scenario, configuration, shape) run over all prompts of the scenario."""

    scenario: str
    config: str
    shape: str
    gamma: int
    tau: float
    tokens_per_s: float
    speedup: float
    cost_ratio: float
    estimated_speedup: float
    matches_ar: bool
    new_tokens: int
    wall_s: float
    weight_traces: list[list[list[float]]] = field(default_factory=list)


def _views(decoder: SpeculativeDecoder, names: Sequence[str], cache: dict[str, PromptView]) -> list[PromptView]:
    for name in names:
        if name not in cache:
            cache[name] = decoder.make_view(name)
    return [cache[n] for n in names]


def measure_cost_ratio(decoder: SpeculativeDecoder, prompt: Sequence[int], rows: int, repeats: int = 30) -> float:
    """T_q / T_p: median time of one draft decoding step over `rows` rows (the ensemble's
    batch) over one target decoding step, both after prefilling `prompt`, on this machine."""
    assert decoder.draft is not None

    def step_time(model, batch: int) -> float:
        runner = ModelRunner(model)
        ids = torch.tensor([list(prompt)] * batch, device=runner.device)
        extra = {}
        if isinstance(prompt, MultimodalPrompt):
            extra = {k: torch.cat([v] * batch).to(runner.device) for k, v in prompt.model_inputs.items() if isinstance(v, torch.Tensor)}
        runner.prefill(ids, torch.ones_like(ids), extra)
        token = torch.full((batch, 1), int(prompt[-1]), dtype=torch.long, device=runner.device)
        pos = runner.committed_len()[:, None]
        vis = torch.ones(batch, 1, 1, dtype=torch.bool, device=runner.device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(token, pos, vis)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            times.append(time.perf_counter() - t0)
            runner.rollback()
        return statistics.median(times[3:])

    return step_time(decoder.draft, rows) / step_time(decoder.target, 1)


def check_tabed_shapes(gammas: Sequence[int], widths: Sequence[int], ablation_gamma: int = 5) -> None:
    """Every chain (gamma draft tokens) and tree (depth `ablation_gamma`, top-d expansion) of the
    matrix fits a step's draft tree (`check_tree_nodes`), named by bench-tabed's flags; checked
    before any model loads."""
    for g in (*gammas, *widths, ablation_gamma):
        if g < 1:
            raise SpecDecError(f"gamma and tree widths must be positive integers (got {g})")
    for g in gammas:
        check_tree_nodes(1 + g, f"--gammas {g} (a chain of {g} draft tokens and its root)", "--gammas")
    for d in widths:
        # eagle2's capacity: d at the first level, d^2 at each further one, and the root
        nodes = 1 + d + (ablation_gamma - 1) * d * d
        check_tree_nodes(nodes, f"--widths {d} (trees of depth {ablation_gamma}, top-{d} expansion: 1 + d + {ablation_gamma - 1} x d^2 nodes)", "--widths")


def run_tabed_bench(
    decoder: SpeculativeDecoder,
    out_dir: Path,
    scenarios: Sequence[str] = SCENARIOS,
    gammas: Sequence[int] = (3, 5, 7),
    widths: Sequence[int] = (2, 3),
    num_prompts: int = 24,
    max_new_tokens: int = 48,
    ablation_gamma: int = 5,
    ablations: bool = True,
    command: str = "",
    log=print,
) -> dict[str, Any]:
    """Run the matrix and write report.md, results.json and plots into `out_dir`."""
    if decoder.draft is None or not decoder.multimodal:
        raise SpecDecError("bench-tabed needs a vision-language target and draft (the bundled LVLM pair by default)")
    check_tabed_shapes(gammas, widths, ablation_gamma)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = decoder.eos_token_ids
    view_cache: dict[str, PromptView] = {}
    cells: list[Cell] = []
    ratio_cache: dict[int, float] = {}
    ar_runs: dict[str, tuple[list[list[int]], float, int]] = {}

    def encode_all(name: str) -> list[Sequence[int]]:
        items = load_prompts(name, limit=num_prompts)
        return [decoder.encode(item.turns[0], item.images) for item in items]

    def run(prompts, policy_name: str, policy_opts: dict, source) -> tuple[list[list[int]], list[int], float, int, list]:
        outputs, lens, wall, new, traces = [], [], 0.0, 0, []
        for prompt in prompts:
            src = source() if callable(source) else source
            engine = SpeculativeEngine(
                decoder.target, make_policy(policy_name, **policy_opts), GreedyRule(), src,
                eos_token_ids=eos, pad_token_id=decoder.pad_token_id, max_context=decoder.max_context,
            )
            t0 = time.perf_counter()
            out = engine.generate([prompt], max_new_tokens)[0]
            wall += time.perf_counter() - t0
            outputs.append(out.token_ids)
            lens.extend(out.stats.accepted_lens)
            new += len(out.token_ids)
            if isinstance(src, EnsembleDraftSource):
                traces.append(src.traces[0])
        return outputs, lens, wall, new, traces

    def source_factory(cfg: DraftConfig):
        views = _views(decoder, cfg.views, view_cache)
        if len(views) == 1:
            view = None if cfg.views[0] == "M" and decoder.draft_view() is None else views[0]
            return lambda: ModelDraftSource(decoder.draft, view=view)
        prior = EnsemblePrior()  # one per configuration and scenario: evidence flows from prompt to prompt
        return lambda: EnsembleDraftSource(decoder.draft, views, EnsembleConfig(**cfg.ensemble), prior)

    encoded = {scenario: encode_all(scenario) for scenario in scenarios}
    checker = SpeculativeEngine(  # every prompt checked against both models' contexts before any run
        decoder.target, make_policy("chain"), GreedyRule(), ModelDraftSource(decoder.draft),
        eos_token_ids=eos, pad_token_id=decoder.pad_token_id, max_context=decoder.max_context,
    )
    for scenario, prompts in encoded.items():
        for i, prompt in enumerate(prompts):
            checker.check_prompt(prompt, max_new_tokens, f"{scenario} prompt {i}")
    for scenario in scenarios:
        prompts = encoded[scenario]
        log(f"[{scenario}] {len(prompts)} prompts: AR")
        ar_out, _, ar_wall, ar_new, _ = run(prompts, "ar", {}, None)
        ar_runs[scenario] = (ar_out, ar_wall, ar_new)
        ar_tps = ar_new / ar_wall
        jobs: list[tuple[DraftConfig, str, int, str, dict]] = []
        for cfg in MAIN_CONFIGS:
            for g in gammas:
                jobs.append((cfg, f"chain g={g}", g, "chain", {"k": g}))
        for cfg in MAIN_CONFIGS:
            if cfg.label in TREE_CONFIGS:
                for d in widths:
                    jobs.append((cfg, f"tree d={d}", ablation_gamma, "eagle2", {"depth": ablation_gamma, "top_k": d, "total_tokens": d * ablation_gamma}))
        if ablations:
            for cfg in ABLATION_CONFIGS:
                jobs.append((cfg, f"chain g={ablation_gamma}", ablation_gamma, "chain", {"k": ablation_gamma}))
        for cfg, shape, gamma, policy_name, opts in jobs:
            m = len(cfg.views)
            if m not in ratio_cache:
                ratio_cache[m] = measure_cost_ratio(decoder, prompts[0], m)
            outputs, lens, wall, new, traces = run(prompts, policy_name, opts, source_factory(cfg))
            cell_tau = tau(lens)
            drafted_per_step = gamma if policy_name == "chain" else opts["total_tokens"]
            draft_forwards = gamma  # one draft forward per level in both shapes
            cell = Cell(
                scenario=scenario, config=cfg.label, shape=shape, gamma=drafted_per_step, tau=cell_tau,
                tokens_per_s=new / wall, speedup=(new / wall) / ar_tps, cost_ratio=ratio_cache[m],
                estimated_speedup=estimated_speedup(cell_tau, draft_forwards, ratio_cache[m]),
                matches_ar=outputs == ar_out, new_tokens=new, wall_s=wall, weight_traces=traces[:4],
            )
            cells.append(cell)
            log(f"[{scenario}] {cfg.label:16s} {shape:10s} tau {cell.tau:.2f}  est {cell.estimated_speedup:.2f}x  measured {cell.speedup:.2f}x  {'ok' if cell.matches_ar else 'MISMATCH'}")
    caption_s = sum(getattr(getattr(v, "captioner", None), "seconds", 0.0) for v in view_cache.values())
    results = {
        "command": command,
        "machine": machine_info(str(decoder.target.device)),
        "versions": versions(),
        "settings": {"scenarios": list(scenarios), "gammas": list(gammas), "widths": list(widths), "num_prompts": num_prompts,
                     "max_new_tokens": max_new_tokens, "ablation_gamma": ablation_gamma},
        "cost_ratio_by_views": {str(k): v for k, v in sorted(ratio_cache.items())},
        "ar": {s: {"tokens_per_s": n / w, "new_tokens": n, "wall_s": w} for s, (_, w, n) in ar_runs.items()},
        "caption_s": caption_s,
        "cells": [asdict(c) for c in cells],
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_report(results, out_dir)
    return results


def _table(cells: list[dict], scenarios: Sequence[str], shape: str, key: str, fmt: str) -> list[str]:
    configs = list(dict.fromkeys(c["config"] for c in cells if c["shape"] == shape))
    lines = ["| drafting | " + " | ".join(scenarios) + " | mean |", "|---" * (len(scenarios) + 2) + "|"]
    best: dict[str, float] = {}
    for s in scenarios:
        vals = [c[key] for c in cells if c["shape"] == shape and c["scenario"] == s]
        best[s] = max(vals) if vals else 0.0
    for cfg in configs:
        row, vals = [], []
        for s in scenarios:
            hit = [c for c in cells if c["shape"] == shape and c["scenario"] == s and c["config"] == cfg]
            if hit:
                v = hit[0][key]
                vals.append(v)
                text = format(v, fmt)
                row.append(f"**{text}**" if v == best[s] else text)
            else:
                row.append("-")
        lines.append(f"| {cfg} | " + " | ".join(row) + f" | {format(statistics.mean(vals), fmt) if vals else '-'} |")
    return lines


def paper_comparison(cells: list[dict], scenarios: Sequence[str], shape: str) -> list[str]:
    """TABED-MT against the single views M and T, as the paper reports it (Table 1)."""
    def get(cfg: str, scenario: str, key: str = "tau") -> float | None:
        hit = [c[key] for c in cells if c["shape"] == shape and c["scenario"] == scenario and c["config"] == cfg]
        return hit[0] if hit else None

    rows, gains, ranks, est = [], [], [], []
    for s in scenarios:
        m, t, tabed = get("M", s), get("T", s), get("TABED-MT", s)
        if None in (m, t, tabed):
            continue
        rank = 1 + sum(v > tabed + 1e-9 for v in (m, t))  # among M, T, TABED-MT
        gain = tabed / ((m + t) / 2) - 1
        ranks.append(rank)
        gains.append(gain)
        est.append(get("TABED-MT", s, "estimated_speedup") or 0.0)
        rows.append(f"| {s} | {m:.2f} | {t:.2f} | {tabed:.2f} | {rank} | {gain:+.1%} |")
    if not rows:
        return []
    return [
        f"## Against the paper ({shape})",
        "",
        "| scenario | M | T | TABED-MT | rank of TABED-MT among M, T, TABED-MT | TABED-MT vs mean(M, T) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Paper (LLaVA-1.5 7B target, 68M draft, GPU): TABED-MT best or second best in every scenario, +5% block efficiency over "
        f"the single views on average, 1.74x estimated walltime speedup by Eq. (1). Here: ranks {', '.join(map(str, ranks))}; "
        f"{statistics.mean(gains):+.1%} over mean(M, T) on average; {statistics.mean(est):.2f}x estimated speedup on average.",
        "",
    ]


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    cells = results["cells"]
    scenarios = results["settings"]["scenarios"]
    shapes = list(dict.fromkeys(c["shape"] for c in cells))
    lines = [
        "# TABED on the bundled LVLM pair: block efficiency per scenario",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {results['machine']['cpu']}, {results['machine']['logical_cores']} logical cores, {results['machine']['torch_threads']} torch threads, "
        f"device {results['machine']['device']}{', ' + results['machine']['gpu'] if 'gpu' in results['machine'] else ''}; "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
        "",
        "Block efficiency τ = tokens committed per target verification step (greedy, batch 1, every prompt of the "
        "scenario). Bold: best in the column. Estimated speedup: TABED's Eq. (1) τ / (γ·T_q/T_p + 1), with T_q/T_p "
        "measured on this machine for a draft batch of m view rows: "
        + ", ".join(f"m={k}: {v:.3f}" for k, v in results["cost_ratio_by_views"].items())
        + ". Measured speedup: tokens/s over plain AR on the same prompts in the same run (noisy; batch 1).",
        "",
        f"All greedy outputs equal AR's: {all(c['matches_ar'] for c in cells)}. Captioning (view C) took {results['caption_s']:.1f} s in total.",
        "",
    ]
    for shape in shapes:
        lines += [f"## τ, {shape}", ""] + _table(cells, scenarios, shape, "tau", ".2f") + [""]
    main_shape = next((s for s in shapes if s == f"chain g={results['settings']['ablation_gamma']}"), shapes[0])
    lines += [f"## Estimated speedup (Eq. 1), {main_shape}", ""] + _table(cells, scenarios, main_shape, "estimated_speedup", ".2f") + [""]
    lines += [f"## Measured speedup over AR, {main_shape}", ""] + _table(cells, scenarios, main_shape, "speedup", ".2f") + [""]
    lines += paper_comparison(cells, scenarios, main_shape)
    ar = results["ar"]
    lines += ["AR tokens/s: " + ", ".join(f"{s} {ar[s]['tokens_per_s']:.1f}" for s in scenarios), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    _plots(results, out_dir)
    return path


def _plots(results: dict[str, Any], out_dir: Path) -> None:
    from specdec.bench.plots import pyplot, save_figure

    plt = pyplot()

    cells = results["cells"]
    scenarios = results["settings"]["scenarios"]
    main = [c for c in cells if c["shape"] == f"chain g={results['settings']['ablation_gamma']}"] or cells
    configs = list(dict.fromkeys(c["config"] for c in main if "h=" not in c["config"] and " " not in c["config"]))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(configs))
    for i, cfg in enumerate(configs):
        vals = [next((c["tau"] for c in main if c["scenario"] == s and c["config"] == cfg), 0.0) for s in scenarios]
        ax.bar([x + i * width for x in range(len(scenarios))], vals, width, label=cfg)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(scenarios))], scenarios)
    ax.set_ylabel("block efficiency τ")
    ax.set_title(f"Block efficiency per scenario ({main[0]['shape'] if main else ''})")
    ax.legend(fontsize="small", ncol=4)
    save_figure(fig, out_dir / "tau_by_scenario.png")
    # the paper's Figure 3: w(M) / (w(M) + w(T)) over decoding steps
    traced = [c for c in main if c["config"] == "TABED-MT" and c["weight_traces"]]
    if traced:
        fig, axes = plt.subplots(1, len(traced), figsize=(4 * len(traced), 3), squeeze=False)
        for ax, cell in zip(axes[0], traced, strict=True):
            for k, trace in enumerate(cell["weight_traces"]):
                share = [w[0] / max(1e-9, w[0] + w[1]) for w in trace]
                ax.plot(range(len(share)), share, marker=".", label=f"prompt {k}")
            ax.set_ylim(-0.05, 1.05)
            ax.set_xlabel("decoding step")
            ax.set_ylabel("w(M) / (w(M) + w(T))")
            ax.set_title(cell["scenario"])
        axes[0][0].legend(fontsize="small")
        save_figure(fig, out_dir / "weights_over_steps.png")
