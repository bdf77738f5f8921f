"""Randomised greedy equivalence: random tiny pairs (architectures, draft noise), methods and their
options, prompt lengths, token budgets, batch sizes, rolling sessions, `max_draft_rows` and forward
modes (dynamic shapes; static shapes; emulated CUDA graphs of the forwards; and of whole drafting
levels, as on a GPU). Every case's greedy outputs must equal `generate()`'s, token for token in
float32 (or differ first at an exact tie of the target's top two logits, which
`specdec.bench.divergence` checks; the small random models tie now and then), and a sampled run of the same case must finish within its budgets.

The suite runs `FUZZ_CASES` fixed cases (seeds 0..N-1; the same every run, so a failure
reproduces). More: `SPECDEC_FUZZ_CASES=500 pytest tests/test_fuzz.py` (seeds 0..499), or
`SPECDEC_FUZZ_SEEDS=1203,1877` for chosen ones; `SPECDEC_FUZZ_DTYPE=bfloat16` runs them in half
precision. The first `LONG_CASES` seeds also run long (budgets of 60-160 tokens, so the KV caches
compact; `SPECDEC_FUZZ_LONG_CASES=N` for more). The case a seed draws is in the failure message."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import EOS, VOCAB, sharpen, tiny_any_config, tiny_model
from test_graph_replay_semantics import ReplayEmulator
from transformers import AutoModelForCausalLM

from specdec.bench.divergence import classify
from specdec.cost.table import CostTable
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule, make_rule

FUZZ_CASES = 16
"""cases the suite runs by default (about 1 s each on a 2-core CPU)"""
LONG_CASES = 4
"""of those, how many also run long (`draw_case(long=True)`: budgets of 60-160, so the caches
compact; 6-8 s each on a 2-core CPU); `SPECDEC_FUZZ_LONG_CASES=N` runs the first N seeds long"""

GPU_LIKE = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 0.2 + 0.01 * b * n)
"""verification nearly flat in the token count, a cheap draft: CAST grows deep, wide trees"""
CPU_LIKE = CostTable.synthetic(lambda b, c, n: 5.0 + 0.5 * b * n, lambda b, c, n: 1.0 + 0.05 * b * n)
"""every verified token costs: CAST keeps small trees, and its plain-step check may skip drafting"""

BASIC_ARCHS = ("llama", "qwen2", "gpt_neox", "gpt2")
OTHER_ARCHS = ("mistral", "gemma2", "phi3")  # sliding windows (mistral, gemma2's mixed layers), soft-capped logits
MODES = ("dynamic", "static", "graphs", "levels")
"""the target's and draft's forward modes: dynamic shapes; static shapes (bucketed, the GPU's
layout); static with every forward replayed from an emulated graph; and with whole drafting levels
captured too (`SPECDEC_CAPTURE_LEVELS=1` on a GPU)"""


@dataclass
class Case:
    seed: int
    arch: str
    noise: float
    method: str
    options: dict[str, Any]
    prompts: list[list[int]]
    budgets: list[int]
    batch_size: int
    max_draft_rows: int | None
    mode: str
    session: bool
    temperature: float
    top_p: float
    top_k: int
    pair: tuple[Any, Any] = field(repr=False, default=(None, None))

    def describe(self) -> str:
        options = {k: ("gpu-like" if v is GPU_LIKE else "cpu-like" if v is CPU_LIKE else v) for k, v in self.options.items()}
        return (
            f"seed {self.seed}: {self.arch} (draft noise {self.noise}), {self.method} {options}, B = {self.batch_size}, "
            f"max_draft_rows {self.max_draft_rows}, {self.mode} forwards, {'a rolling session' if self.session else 'generate()'}, "
            f"prompt lengths {[len(p) for p in self.prompts]}, budgets {self.budgets}"
        )


def random_options(rng: random.Random, method: str) -> dict[str, Any]:
    if method == "chain":
        return {"k": rng.randint(1, 7)}
    if method == "static":
        return rng.choice([{}, {"depth": rng.randint(1, 5), "branching": rng.randint(1, 3), "max_nodes": rng.randint(1, 40)}])
    if method == "eagle2":
        return {"depth": rng.randint(1, 6), "top_k": rng.randint(1, 4), "total_tokens": rng.randint(1, 30)}
    if method == "dynatree":
        return rng.choice(
            [{}, {"free_tokens": rng.randint(2, 40)}, {"max_nodes": rng.randint(1, 20)}, {"phase": rng.randint(0, 3)}, {"calibrate": False}]
        )
    options: dict[str, Any] = {
        "cost_table": rng.choice([GPU_LIKE, CPU_LIKE]),
        "plain_steps": rng.choice([True, False]),
        "reads_while_drafting": rng.choice([True, False, None]),
    }
    if rng.random() < 0.3:
        options["deterministic"] = True
    if rng.random() < 0.3:
        options.update(top_k=rng.randint(1, 5), total_tokens=rng.randint(1, 40))
    return options


def draw_case(seed: int, long: bool = False) -> Case:
    """The case of `seed`; `long`: the same models, method and mode with 2-6 prompts of 1-60 tokens
    and budgets of 60-160 in a rolling session of 2-5 rows, so the KV caches compact (both kinds:
    `ModelRunner.compact_if_wasteful`)."""
    rng = random.Random(seed)
    arch = rng.choice(BASIC_ARCHS + BASIC_ARCHS + OTHER_ARCHS)
    noise = rng.choice([0.0, 0.01, 0.02, 0.05, 0.3])
    method = rng.choice(["chain", "static", "eagle2", "dynatree", "dynatree", "cast", "cast", "cast"])
    options = random_options(rng, method)
    prompts = [[rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 6))]
    budgets = [rng.randint(1, 30) for _ in prompts]
    case = Case(
        seed,
        arch,
        noise,
        method,
        options,
        prompts,
        budgets,
        batch_size=rng.randint(1, 5),
        max_draft_rows=rng.choice([None, None, None, 1, 2]),
        mode=rng.choice(MODES),
        session=rng.random() < 0.5 or len(set(budgets)) > 1,
        temperature=rng.choice([0.5, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
    )
    if long:
        more = random.Random(10_000 + seed)
        case.prompts = [[more.randint(3, VOCAB - 1) for _ in range(more.randint(1, 60))] for _ in range(more.randint(2, 6))]
        case.budgets = [more.randint(60, 160) for _ in case.prompts]
        case.session, case.batch_size = True, more.randint(2, 5)
    case.pair = make_pair(arch, noise)
    return case


FUZZ_DTYPE = getattr(torch, os.environ.get("SPECDEC_FUZZ_DTYPE", "float32"))
"""the models' dtype (`SPECDEC_FUZZ_DTYPE=bfloat16`: half precision, where the first divergence of
every differing output must be a numerical tie in that dtype)"""


def make_pair(arch: str, noise: float) -> tuple[Any, Any]:
    """A target and a draft with its weights plus `noise` times Gaussian noise (0: the same model),
    in `FUZZ_DTYPE`."""
    if arch in BASIC_ARCHS:
        target = sharpen(tiny_model(arch, seed=0))  # peaked distributions, few ties
    else:
        torch.manual_seed(0)
        target = sharpen(AutoModelForCausalLM.from_config(tiny_any_config(arch)).eval())
    draft = AutoModelForCausalLM.from_config(target.config).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return target.to(FUZZ_DTYPE), draft.to(FUZZ_DTYPE)


def build_engine(case: Case, rule: Any) -> SpeculativeEngine:
    target, draft = case.pair
    policy = make_policy(case.method, **case.options)
    if case.mode == "dynamic":
        return SpeculativeEngine(target, policy, rule, ModelDraftSource(draft), eos_token_ids=[EOS], max_draft_rows=case.max_draft_rows)
    source = ModelDraftSource(draft, static_shapes=True)
    engine = SpeculativeEngine(target, policy, rule, source, eos_token_ids=[EOS], static_shapes=True, max_draft_rows=case.max_draft_rows)
    if case.mode in ("graphs", "levels"):
        engine.target.graphs, source.runner.graphs = ReplayEmulator(), ReplayEmulator()
    if case.mode == "levels":
        source.runner.level_graphs = ReplayEmulator()
        source.runner.capture_every_level = True  # greedy steps' levels too
        source.runner.time_forwards = False  # captured levels need untimed forwards
    return engine


def decode(case: Case, engine: SpeculativeEngine, params: SamplingParams | None = None) -> list[list[int]]:
    if not case.session:
        return [
            o.token_ids for o in engine.generate(case.prompts, case.budgets[0], params=params, seed=case.seed, batch_size=case.batch_size)
        ]
    session = engine.session(params=params, seed=case.seed, max_rows=case.batch_size)
    requests = [session.submit(p, n) for p, n in zip(case.prompts, case.budgets, strict=True)]
    while session.unfinished:
        session.step()
    return [r.token_ids for r in requests]


def reference(target: Any, prompt: list[int], budget: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def fuzz_seeds() -> list[int]:
    chosen = os.environ.get("SPECDEC_FUZZ_SEEDS")
    if chosen:
        return [int(s) for s in chosen.split(",") if s.strip()]
    return list(range(int(os.environ.get("SPECDEC_FUZZ_CASES", FUZZ_CASES))))


def fuzz_params() -> list[Any]:
    """(seed, long) per case: every seed short, and the first `LONG_CASES` (every chosen seed with
    SPECDEC_FUZZ_SEEDS) long as well."""
    seeds = fuzz_seeds()
    n_long = len(seeds) if os.environ.get("SPECDEC_FUZZ_SEEDS") else int(os.environ.get("SPECDEC_FUZZ_LONG_CASES", LONG_CASES))
    return [pytest.param(seed, False, id=f"{seed}") for seed in seeds] + [pytest.param(seed, True, id=f"{seed}-long") for seed in seeds[:n_long]]


@pytest.mark.parametrize(("seed", "long"), fuzz_params())
def test_random_case_decodes_as_generate(seed, long):
    case = draw_case(seed, long)
    refs = [reference(case.pair[0], p, n) for p, n in zip(case.prompts, case.budgets, strict=True)]
    outs = decode(case, build_engine(case, GreedyRule()))
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        if out != ref:  # only where the target's top two logits tie exactly (either is its greedy choice)
            divergence = classify(case.pair[0], case.prompts[i], out, ref)
            assert divergence is not None and divergence.kind == "numerical tie", (
                f"{case.describe()}: prompt {i} decoded {out}, generate() gave {ref}; {divergence}"
            )
    params = SamplingParams(temperature=case.temperature, top_p=case.top_p, top_k=case.top_k)
    sampled = decode(case, build_engine(case, make_rule("sampling")), params)
    for out, budget in zip(sampled, case.budgets, strict=True):
        assert 1 <= len(out) <= budget and all(0 <= t < VOCAB for t in out), f"{case.describe()}, sampled: {out}"
        assert EOS not in out[:-1], f"{case.describe()}, sampled: tokens after EOS: {out}"


def test_the_comparison_catches_a_wrong_model():
    """The check can fail: the same cases decoded with the draft (noise 0.3) in the target's place
    differ from the target's generate() somewhere."""
    mismatched = 0
    for seed in range(4):
        case = draw_case(seed)
        case.pair = make_pair(case.arch, 0.3)
        refs = [reference(case.pair[0], p, n) for p, n in zip(case.prompts, case.budgets, strict=True)]
        case.pair = (case.pair[1], case.pair[1])
        outs = decode(case, build_engine(case, GreedyRule()))
        mismatched += sum(out != ref for out, ref in zip(outs, refs, strict=True))
    assert mismatched > 0
