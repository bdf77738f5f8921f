"""`max_draft_rows`: a step with more active rows than the limit drafts nothing (a plain step),
the draft catches up at the next drafted step, and outputs stay the target's own."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, close_pair

from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.cost import CostTable
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.sources.lookup import LookupDraftSource
from specdec.verification import GreedyRule, SamplingRule

# uneven budgets: the rolling batch shrinks through every size from 4 to 1
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47], [20, 21], [60, 61, 62, 63], [30, 31, 32]]
BUDGETS = [24, 9, 30, 14, 18, 6]
# CAST with a synthetic cost table whose drafting pays (overhead-dominated forwards)
CAST_COSTS = CostTable.synthetic(lambda b, c, n: 10.0 + 0.05 * b * n + c / 1000, lambda b, c, n: 1.0 + 0.01 * b * n)
OPTIONS = {
    "chain": {"k": 3},
    "static": {"depth": 2, "branching": 2, "max_nodes": 8},
    "eagle2": {"depth": 3, "top_k": 3, "total_tokens": 8},
    "dynatree": {},
    "cast": {"cost_table": CAST_COSTS},
}


@pytest.fixture(scope="module")
def pair():
    return close_pair("llama")


def engine(pair, method: str, limit: int | None, rule=None, source=None, static_shapes: bool = False) -> SpeculativeEngine:
    target, draft = pair
    return SpeculativeEngine(
        target, make_policy(method, **OPTIONS[method]), rule or GreedyRule(), source or ModelDraftSource(draft, static_shapes=static_shapes),
        eos_token_ids=[EOS], max_context=256, max_draft_rows=limit, static_shapes=static_shapes,
    )


def decode(eng: SpeculativeEngine, params: SamplingParams | None = None, seed: int | None = None, max_rows: int = 4, budgets: list[int] = BUDGETS):
    session = eng.session(params, seed=seed, max_rows=max_rows, keep_steps=True)
    requests = [session.submit(p, n) for p, n in zip(PROMPTS, budgets, strict=True)]
    while session.unfinished:
        session.step()
    return [r.token_ids for r in requests], session.records


def ar_outputs(pair, budgets: list[int] = BUDGETS) -> list[list[int]]:
    """transformers' own greedy generate() of each prompt alone"""
    target, _ = pair
    outputs = []
    for prompt, budget in zip(PROMPTS, budgets, strict=True):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("method", list(OPTIONS))
@pytest.mark.parametrize("limit", [1, 2])
def test_greedy_output_is_the_targets_and_large_batches_draft_nothing(pair, method, limit):
    outputs, records = decode(engine(pair, method, limit))
    assert outputs == ar_outputs(pair)
    over = [r for r in records if sum(r.active) > limit]
    under = [r for r in records if 0 < sum(r.active) <= limit]
    assert over and under, "the rolling batch passes both sides of the limit"
    assert all(max(r.drafted) == 0 for r in over), "a step with more active rows than the limit drafts nothing"
    assert any(max(r.drafted) > 0 for r in under), "at or below the limit the policy drafts again"


@pytest.mark.parametrize("method", ["chain", "eagle2"])
def test_static_shapes_with_a_limit(pair, method):
    """The capturable forward mode (CUDA graphs' shapes): finished rows ride along inactive and
    do not count towards the limit; outputs stay the target's."""
    outputs, records = decode(engine(pair, method, 2, static_shapes=True))
    assert outputs == ar_outputs(pair)
    assert all(max(r.drafted) == 0 for r in records if sum(r.active) > 2)
    assert any(max(r.drafted) > 0 for r in records if len(r.active) > 2 and sum(r.active) <= 2), "riders do not count"


def test_without_a_limit_large_batches_draft(pair):
    _, records = decode(engine(pair, "chain", None))
    assert any(max(r.drafted) > 0 for r in records if sum(r.active) > 2)


def test_lookup_source_defers_too(pair):
    outputs, records = decode(engine(pair, "chain", 1, source=LookupDraftSource(vocab_size=pair[0].config.vocab_size, max_ngram=2)))
    assert outputs == ar_outputs(pair)
    assert all(max(r.drafted) == 0 for r in records if sum(r.active) > 1)


def test_sampling_with_a_limit_is_reproducible(pair):
    """Sampled decoding with the limit: a seed gives the same tokens twice (plain steps and
    catch-ups consume the generator the same way each time)."""
    params = SamplingParams(temperature=1.0)
    first, records = decode(engine(pair, "eagle2", 2, rule=SamplingRule()), params, seed=3)
    again, _ = decode(engine(pair, "eagle2", 2, rule=SamplingRule()), params, seed=3)
    assert first == again
    assert all(max(r.drafted) == 0 for r in records if sum(r.active) > 2)


def test_cast_is_told_the_draft_owes_tokens(pair):
    eng = engine(pair, "cast", 1)
    session = eng.session(max_rows=2, keep_steps=True)
    session.submit(PROMPTS[0], 10)
    session.submit(PROMPTS[2], 10)
    session.step()  # two active rows: a plain step the policy was not asked for
    assert max(session.records[-1].drafted) == 0
    assert eng.policy._owed and eng.policy.plain_check._discard_next


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_limit_is_refused(pair, bad):
    with pytest.raises(SpecDecError, match="max_draft_rows"):
        engine(pair, "chain", bad)


def test_bad_limit_is_refused_before_loading(tiny_pair_dir, monkeypatch):
    import specdec.api

    monkeypatch.setattr(specdec.api, "load_model", lambda *a, **k: pytest.fail("loaded before the bad value was reported"))
    with pytest.raises(SpecDecError, match="max_draft_rows=0"):
        SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu", max_draft_rows=0)


def test_cli_flag(tiny_pair_dir, capsys):
    pair_args = ["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--device", "cpu"]
    assert main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "4", "--max-draft-rows", "-1", *pair_args]) != 0
    assert "max_draft_rows=-1 must be a positive integer" in capsys.readouterr().err
    assert main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "4", "--max-draft-rows", "1", *pair_args]) == 0


def test_a_draft_owed_its_most_tokens_drafts_once_and_catches_up(pair):
    """Past `max_pending` owed tokens the source refuses to defer: that step drafts (its first
    forward catches up on everything owed), and the output is still the target's own."""
    target, draft = pair
    source = ModelDraftSource(draft)
    source.max_pending = 3
    eng = engine(pair, "chain", 1, source=source)
    outputs, records = decode(eng)
    assert outputs == ar_outputs(pair)
    over = [max(r.drafted) for r in records if sum(r.active) > 1]
    assert any(d > 0 for d in over), "some step over the limit drafted: the source could not owe more"
    assert sum(d == 0 for d in over) > sum(d > 0 for d in over)


def lazy_and_eager(pair, method: str, budgets: list[int]):
    """The prompts decoded at a limit of 2 rows with the draft's prefills deferred (the default),
    then with them at admission; per engine its outputs, step records and draft prefills, each as
    (rows replaced, 0 for a new batch; prompt width)."""
    lazy_engine, eager_engine = engine(pair, method, 2), engine(pair, method, 2)
    eager_engine.lazy_draft_prefill = False
    calls: list[tuple[int, int]] = []
    real = ModelDraftSource.prefill_rows

    def counting(self, input_ids, attention_mask, rows, model_inputs=None):
        calls.append((0 if rows is None else len(rows), input_ids.shape[1]))
        return real(self, input_ids, attention_mask, rows, model_inputs)

    results = []
    ModelDraftSource.prefill_rows = counting
    try:
        for eng in (lazy_engine, eager_engine):
            calls.clear()
            out, records = decode(eng, budgets=budgets)
            results.append((out, records, list(calls)))
    finally:
        ModelDraftSource.prefill_rows = real
    return results


@pytest.mark.parametrize("method", ["chain", "eagle2"])
def test_prompts_admitted_over_the_limit_are_prefilled_into_the_draft_when_it_drafts_again(pair, method):
    """A prompt that joins a batch running more rows than the limit is not prefilled into the
    draft at admission (those steps draft nothing); before the next step that drafts, it is, with
    everything committed but the root. The draft then proposes exactly what an eager prefill
    would have let it propose: every step's accepted lengths equal the eager engine's."""
    budgets = [10, 12, 9, 14, 30, 28]  # the last two join a batch of four and outlive it
    (lazy_out, lazy_records, lazy_calls), (eager_out, eager_records, eager_calls) = lazy_and_eager(pair, method, budgets)
    assert lazy_out == eager_out == ar_outputs(pair, budgets)
    assert [rows for rows, _ in eager_calls] == [0, 1, 1], "eager: the first batch, then each prompt at its admission"
    assert [rows for rows, _ in lazy_calls] == [0, 2], "lazy: both late prompts at once, when the batch drafts again"
    assert [r.accepted_len for r in lazy_records] == [r.accepted_len for r in eager_records]
    assert [r.drafted for r in lazy_records] == [r.drafted for r in eager_records]
    assert any(max(r.drafted) > 0 for r in lazy_records[-5:]), "the late prompts drafted after the catch-up"


@pytest.mark.parametrize("method", ["chain", "eagle2"])
def test_a_new_batch_over_the_limit_prefills_the_draft_only_for_the_rows_that_draft(pair, method):
    """A batch that starts with more rows than the limit gives the draft one token a row (its
    prompt's last), not the prompts: its steps draft nothing. Only the rows still running when the
    batch drafts again are prefilled, then, with everything they committed but the root; the rows
    that finished first never are. The draft proposes what an eager prefill would have let it
    propose: every step's accepted lengths equal the eager engine's, and the outputs are AR's."""
    budgets = [30, 6, 8, 7, 5, 28]  # four rows start (over the limit of 2); rows 0 and 5 outlive the rest
    (lazy_out, lazy_records, lazy_calls), (eager_out, eager_records, eager_calls) = lazy_and_eager(pair, method, budgets)
    assert lazy_out == eager_out == ar_outputs(pair, budgets)
    assert eager_calls[0] == (0, max(len(p) for p in PROMPTS[:4])), "eager: the first batch's prompts"
    assert lazy_calls[0] == (0, 1), "lazy: the new batch gets one token a row"
    late = lazy_calls[1:]
    assert late and all(rows > 0 and width > 1 for rows, width in late), "then whole rows, when the batch drafts again"
    assert sum(rows for rows, _ in late) < len(PROMPTS), "rows that finished before the batch drafted were never prefilled"
    assert [r.accepted_len for r in lazy_records] == [r.accepted_len for r in eager_records]
    assert [r.drafted for r in lazy_records] == [r.drafted for r in eager_records]
    assert any(max(r.drafted) > 0 for r in lazy_records), "the batch drafted once it was small enough"
