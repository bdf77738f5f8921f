"""`DecodeSession`: the engine's decode loop step by step, with prompts joining and leaving a running batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EOS, sharpen, tiny_model

from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule, SamplingRule

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47], [20, 21], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=0))
    with torch.no_grad():  # close to the target: some drafts accepted, rows advance unevenly
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return target, draft


def engine(pair, method: str = "chain", rule=None) -> SpeculativeEngine:
    target, draft = pair
    options = {"chain": {"k": 3}, "static": {"depth": 2, "branching": 2, "max_nodes": 8}, "ar": {}}[method]
    return SpeculativeEngine(target, make_policy(method, **options), rule or GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS], max_context=256)


@pytest.mark.parametrize("method", ["chain", "static", "ar"])
def test_prompts_joining_a_running_batch_decode_as_alone(pair, method):
    """Prompts submitted between steps join free rows (the batch grows, then shrinks); each
    output equals the prompt decoded on its own."""
    alone = [engine(pair, method).generate([p], 20)[0].token_ids for p in PROMPTS]
    session = engine(pair, method).session(max_rows=3)
    requests = [session.submit(PROMPTS[0], 20)]
    schedule = {2: [1], 4: [2, 3], 7: [4]}  # step -> prompts submitted before it
    sizes = []
    step = 0
    while not session.idle or step <= max(schedule):
        for i in schedule.get(step, []):
            requests.append(session.submit(PROMPTS[i], 20))
        session.step()
        sizes.append(len(session.rows))
        step += 1
    assert [r.token_ids for r in requests] == alone
    assert max(sizes) == 3, "never more rows than max_rows"
    assert all(r.finish_reason in ("eos", "length") for r in requests)
    assert [r.index for r in requests] == [0, 1, 2, 3, 4]


def test_cancel_frees_the_row_and_keeps_the_others(pair):
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # none ends at EOS within 16 tokens
    alone = [engine(pair).generate([p], 16)[0].token_ids for p in prompts]
    session = engine(pair).session(max_rows=2)
    first, second, third = (session.submit(p, 16) for p in prompts)
    session.step()
    session.step()
    assert session.running == 2 and len(session.waiting) == 1
    session.cancel(first, "stop")
    assert first.finish_reason == "stop" and first.done and session.running == 1
    kept = list(first.token_ids)
    session.step()  # the freed row goes to the waiting prompt at this boundary
    assert third.running and session.running == 2
    while not session.idle:
        session.step()
    assert first.token_ids == kept and kept == alone[0][: len(kept)]
    assert second.token_ids == alone[1] and third.token_ids == alone[2]


def test_cancel_a_waiting_request_never_starts_it(pair):
    session = engine(pair).session(max_rows=1)
    running = session.submit(PROMPTS[0], 8)
    session.step()
    waiting = session.submit(PROMPTS[1], 8)
    session.cancel(waiting)
    assert waiting.finish_reason == "cancelled" and not session.waiting and running.running
    while not session.idle:
        session.step()
    assert waiting.token_ids == [] and waiting.admitted_at is None and running.finish_reason in ("eos", "length")


def test_callback_may_cancel_its_own_request(pair):
    """on_tokens runs inside step; cancelling there ends the request at once."""
    session = engine(pair).session()
    seen: list[int] = []

    def stop_after_five(request, tokens):
        seen.extend(tokens)
        if len(seen) >= 5:
            session.cancel(request, "stop")

    request = session.submit(PROMPTS[0], 30, on_tokens=stop_after_five)
    steps = 0
    while not session.idle:
        session.step()
        steps += 1
    assert request.finish_reason == "stop" and request.token_ids == seen and 5 <= len(seen) < 30
    assert request.stats.new_tokens == len(seen) and request.stats.wall_s > 0


def test_seeded_request_alone_reproduces_generate(pair):
    """A request's seed reseeds the session when it starts a fresh batch: alone, it samples
    exactly what `generate(seed=...)` samples."""
    params = SamplingParams(temperature=1.0)
    reference = engine(pair, rule=SamplingRule()).generate([PROMPTS[0]], 16, params, seed=11)[0].token_ids
    session = engine(pair, rule=SamplingRule()).session(params)
    for _ in range(2):
        request = session.submit(PROMPTS[0], 16, seed=11)
        while not session.idle:
            session.step()
        assert request.token_ids == reference


def test_submit_checks_the_prompt(pair):
    session = engine(pair).session()
    with pytest.raises(SpecDecError, match="empty"):
        session.submit([], 4)
    with pytest.raises(SpecDecError, match="exceeds the model's context of 256 tokens; lower max_new_tokens to at most 251"):
        session.submit(PROMPTS[0], 300)
    with pytest.raises(SpecDecError, match="max_rows=0"):
        engine(pair).session(max_rows=0)
    assert session.idle and session.step() is None


def test_release_frees_the_caches_of_an_idle_session(pair):
    from specdec.sources.lookup import LookupDraftSource

    target, _ = pair
    lookup = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), LookupDraftSource(vocab_size=96), eos_token_ids=[EOS], max_context=256)
    for eng in (engine(pair), lookup):
        session = eng.session(max_rows=2)
        session.release()  # never ran: nothing to free
        first = session.submit(PROMPTS[0], 12)
        session.step()
        session.release()  # rows run: kept
        assert eng.target.batch_size == 1
        while not session.idle:
            session.step()
        session.release()
        assert eng.target.batch_size == 0 and eng.target.past_len == 0
        again = session.submit(PROMPTS[0], 12)
        while not session.idle:
            session.step()
        assert again.token_ids == first.token_ids


class _FakeEvent:
    """A CUDA event stand-in: records the host clock; elapsed_time in ms, as torch's."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        import time

        self.at = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "read before both events were recorded"
        return (end.at - self.at) * 1e3


def test_phase_clock_reads_the_device_timeline_on_cuda(monkeypatch):
    """On a CUDA device a phase only queues kernels, so the step's draft and verify spans come
    from events recorded at the phase marks (read after the step's host read), not the host
    clock; on a CPU they are wall time."""
    from specdec.engine import PhaseClock

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    clock = PhaseClock(torch.device("cuda"))
    for phase in range(3):
        clock.mark(phase)
    draft_s, verify_s = clock.spans()
    assert clock.events[0].at <= clock.events[1].at <= clock.events[2].at
    assert draft_s == pytest.approx(clock.events[1].at - clock.events[0].at) and verify_s == pytest.approx(clock.events[2].at - clock.events[1].at)
    cpu = PhaseClock(torch.device("cpu"))
    assert cpu.events == []
    for phase in range(3):
        cpu.mark(phase)
    assert cpu.spans() == (cpu.times[1] - cpu.times[0], cpu.times[2] - cpu.times[1])


def test_steps_take_their_phase_spans_from_the_clock(pair, monkeypatch):
    """The step records (and so the stats and CAST's learned overheads) take drafting and
    verification time from the session's PhaseClock."""
    import specdec.engine as engine_module

    class FixedClock(engine_module.PhaseClock):
        def spans(self) -> tuple[float, float]:
            return 0.5, 0.25

    monkeypatch.setattr(engine_module, "PhaseClock", FixedClock)
    outs = engine(pair, "chain").generate(PROMPTS[:2], 6, keep_steps=True)
    steps = outs[0].steps
    assert steps and all((s.draft_s, s.verify_s) == (0.5, 0.25) for s in steps)
    assert outs[0].stats.draft_s == pytest.approx(0.5 * outs[0].stats.steps)


# ----- bad input to the engine-level API: a SpecDecError naming the value and the fix ------------


@pytest.mark.parametrize(
    ("swap", "needle"),
    [
        ({"policy": "chain"}, "make_policy('chain', **options)"),
        ({"rule": "greedy"}, "make_rule('greedy')"),
        ({"rule": GreedyRule}, "the class GreedyRule (pass an instance)"),
        ({"source": "draft"}, "source must be a draft source"),
        ({"target": "target/dir"}, "target must be a loaded causal LM"),
        ({"eos_token_ids": EOS}, f"eos_token_ids={EOS} must be a list of integer token ids (empty: no EOS); pass [{EOS}]"),
        ({"eos_token_ids": str(EOS)}, f"eos_token_ids='{EOS}' must be a list"),  # a set of characters: never an EOS
        ({"eos_token_ids": [torch.tensor(EOS)]}, "eos_token_ids holds tensor(2), not an integer token id"),  # hashed by identity: never an EOS
        ({"eos_token_ids": [EOS, 96]}, "eos_token_ids holds 96, outside the target's token ids (0..95)"),  # never emitted: rows ran to their budget
        ({"eos_token_ids": [-1]}, "eos_token_ids holds -1, outside the target's token ids"),
        ({"pad_token_id": None}, "pad_token_id=None must be a token id in 0..95"),
        ({"pad_token_id": 96}, "pad_token_id=96 must be a token id in 0..95"),  # an IndexError in the embedding once rows were padded
        ({"max_context": 0}, "max_context=0 must be a positive integer"),
        ({"max_context": "256"}, "max_context='256' must be a positive integer"),
    ],
)
def test_engine_arguments_of_the_wrong_kind_are_named(pair, swap, needle):
    target, draft = pair
    args = {"target": target, "policy": make_policy("chain", k=3), "rule": GreedyRule(), "source": ModelDraftSource(draft), "eos_token_ids": [EOS], "max_context": 256}
    with pytest.raises(SpecDecError) as err:
        SpeculativeEngine(**{**args, **swap})
    assert needle in str(err.value)


def test_a_bare_draft_model_as_source_says_to_wrap_it(pair):
    target, draft = pair
    with pytest.raises(SpecDecError, match=r"source is a model \(LlamaForCausalLM\), not a draft source; wrap it: specdec.sources.ModelDraftSource\(draft\)"):
        SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), draft, eos_token_ids=[EOS])


def test_eos_ids_given_as_a_tensor_stop_rows():
    """A tensor of ids is read as its integers (a set of 0-d tensors never matched a token)."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1)
    first = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), ModelDraftSource(draft)).generate([PROMPTS[0]], 6)[0].token_ids[0]
    eng = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), ModelDraftSource(draft), eos_token_ids=torch.tensor([first]))
    out = eng.generate([PROMPTS[0]], 6)[0]
    assert (out.token_ids, out.finish_reason) == ([first], "eos")


@pytest.mark.parametrize(
    ("prompts", "needle"),
    [
        ("def f():", "prompts is a string ('def f():'); the engine takes token ids: encode it first"),
        (["def f():"], "prompt 0 is a string"),
        ([[5.5, 6.0]], "prompt 0 holds 5.5, not an integer token id"),  # was truncated to 5 silently
        ([[[5, 6]]], "prompt 0 holds [5, 6], not an integer token id"),
        ((p for p in PROMPTS), "got generator; pass list(prompts)"),
    ],
)
def test_prompts_must_be_lists_of_token_ids(pair, prompts, needle):
    with pytest.raises(SpecDecError) as err:
        engine(pair).generate(prompts, 4)
    assert needle in str(err.value)


def test_session_arguments_are_checked_before_any_work(pair):
    eng = engine(pair, rule=SamplingRule())
    with pytest.raises(SpecDecError, match=r"params must be a specdec.sampling.SamplingParams, got dict; pass SamplingParams\(\*\*params\)"):
        eng.generate([PROMPTS[0]], 4, params={"temperature": 0.8})
    with pytest.raises(SpecDecError, match="seed='1' must be an integer"):  # a RuntimeError from manual_seed
        eng.generate([PROMPTS[0]], 4, params=SamplingParams(temperature=1.0), seed="1")
    with pytest.raises(SpecDecError, match="seed=-1 must be at least 0"):  # silently the seed 2**64 - 1
        eng.session(seed=-1)
    with pytest.raises(SpecDecError, match="stream=5 must be a function"):
        eng.generate([PROMPTS[0]], 4, stream=5)
    session = eng.session()
    with pytest.raises(SpecDecError, match="seed=1.5 must be an integer"):  # was raised at the step that admitted it
        session.submit(PROMPTS[0], 4, seed=1.5)
    with pytest.raises(SpecDecError, match="on_tokens='print' must be a function"):
        session.submit(PROMPTS[0], 4, on_tokens="print")
    assert session.idle  # nothing was queued
    request = session.submit(PROMPTS[0], 4)
    with pytest.raises(SpecDecError, match="reason=None must be a non-empty string"):  # the request had left the queue, never finishing
        session.cancel(request, None)
    assert list(session.waiting) == [request] and not request.done
    with pytest.raises(SpecDecError, match="temperature=True must be a finite number"):
        SamplingParams(temperature=True)
    assert SamplingParams(temperature=np.float32(0.5)).temperature == 0.5  # a number, as top_p takes numpy's


def test_a_session_whose_caches_another_session_took_says_so(pair):
    """An engine holds one batch's caches: a session stepped after another session (here
    engine.generate) used them had decoded on from the other's caches, a silently wrong output."""
    alone = engine(pair).generate([PROMPTS[2]], 16)[0].token_ids
    eng = engine(pair)
    session = eng.session()
    lost = session.submit(PROMPTS[2], 16)
    session.step()
    session.step()
    eng.generate([PROMPTS[3]], 5)
    with pytest.raises(SpecDecError, match="lost their KV caches: another session on the same engine"):
        session.step()
    session.cancel(lost)  # nothing left running: the session goes on with a fresh batch
    assert session.step() is None and session.idle
    again = session.submit(PROMPTS[2], 16)
    while not session.idle:
        session.step()
    assert again.token_ids == alone

    idle = eng.session()  # an idle session's release frees only caches it still holds
    idle.submit(PROMPTS[1], 1)
    idle.step()
    assert idle.idle
    busy = eng.session()
    running = busy.submit(PROMPTS[2], 16)
    busy.step()
    idle.release()
    while not busy.idle:
        busy.step()
    assert running.token_ids == alone


def test_a_callback_that_raises_leaves_the_session_whole(pair):
    """The error surfaces at the end of the step: raised mid-step it had left the caches advanced
    but the roots and the draft source behind, and a session stepped on decoded wrong tokens."""
    alone = engine(pair).generate([PROMPTS[2]], 20)[0].token_ids
    calls = []

    def on_tokens(request, tokens):
        calls.append(tokens)
        if len(calls) == 3:
            raise RuntimeError("a bug in the caller's callback")

    session = engine(pair).session()
    request = session.submit(PROMPTS[2], 20, on_tokens=on_tokens)
    raised = 0
    while not session.idle:
        try:
            session.step()
        except RuntimeError:
            raised += 1
    assert raised == 1 and request.token_ids == alone and sum(calls, []) == alone


def test_the_greedy_rule_refuses_sampling_params(pair):
    """Argmax verification of sampled roots and drafts had silently been neither greedy decoding
    nor the target's distribution (SpeculativeDecoder refuses --verify greedy with a temperature)."""
    with pytest.raises(SpecDecError, match=r"the greedy accept rule needs temperature 0 \(got temperature=0.8\); build the engine with make_rule\('sampling'\)"):
        engine(pair).generate([PROMPTS[0]], 4, params=SamplingParams(temperature=0.8))
    assert engine(pair, rule=SamplingRule()).generate([PROMPTS[0]], 4, params=SamplingParams(temperature=0.8), seed=0)[0].token_ids


def test_session_arguments_are_checked_before_cast_prepares_its_costs(pair):
    """Bad sampling params are named before a cost-aware policy measures anything for the batch."""
    target, draft = pair
    policy = make_policy("cast")
    prepared: list[int] = []
    policy.prepare_costs = prepared.append  # type: ignore[method-assign]
    eng = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
    with pytest.raises(SpecDecError, match="params must be a specdec.sampling.SamplingParams"):
        eng.session({"temperature": 0.5}, max_rows=2)  # type: ignore[arg-type]
    assert prepared == []
    eng.session(SamplingParams(), max_rows=2)
    assert prepared == [2]


@pytest.mark.parametrize("method", ["dynatree", "cast", "eagle2"])
@pytest.mark.parametrize("static_shapes", [False, True])
def test_calls_inside_and_outside_inference_mode_mix(pair, method, static_shapes):
    """One engine called inside `torch.inference_mode()`, then outside it, then inside again, as
    a notebook or a serving framework may: every call decodes the target's own greedy text. The
    state kept from call to call (calibration tables, KV caches, slot bookkeeping) was made as
    inference tensors in the first call, and the second call's in-place updates of it raised
    before steps ran under inference mode themselves (DynaTree's and CAST's calibration)."""
    from specdec.cost import CostTable

    target, draft = pair
    options = {"cost_table": CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)} if method == "cast" else {}
    eng = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft, static_shapes=static_shapes), eos_token_ids=[EOS], static_shapes=static_shapes)
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in PROMPTS[:3]]
    for inside in (True, False, True):
        with torch.inference_mode(inside):
            outs = eng.generate(PROMPTS[:3], 16, batch_size=2)
        assert [o.token_ids for o in outs] == refs, inside


def test_first_tokens_stream_before_the_drafts_prefill(pair):
    """Admission hands each prompt's first token (chosen by the target alone) to its callback
    before the draft's prefill runs, for a new batch and for a prompt joining a running one;
    the draft's prefill counts in prefill time, not in time to first token, and the text is the
    one decoded alone."""
    alone = [engine(pair).generate([p], 12)[0].token_ids for p in PROMPTS[:3]]
    eng = engine(pair)
    events: list[tuple[str, object]] = []
    prefill = eng.source.prefill

    def logged_prefill(input_ids, attention_mask, rows=None, prompts=None):
        events.append(("draft prefill", None if rows is None else tuple(rows)))
        return prefill(input_ids, attention_mask, rows, prompts=prompts)

    eng.source.prefill = logged_prefill
    session = eng.session(max_rows=3)

    def on_tokens(request, tokens):
        if len(request.token_ids) == len(tokens):  # the first call: the first token
            events.append(("first token", request.index))

    requests = [session.submit(p, 12, on_tokens=on_tokens) for p in PROMPTS[:2]]
    session.step()
    requests.append(session.submit(PROMPTS[2], 12, on_tokens=on_tokens))
    while not session.idle:
        session.step()
    assert events[:3] == [("first token", 0), ("first token", 1), ("draft prefill", None)]
    assert events[3] == ("first token", 2) and events[4][0] == "draft prefill" and len(events[4][1]) == 1, events  # (its batch row)
    assert [r.token_ids for r in requests] == alone
    for r in requests:
        assert 0 < r.stats.ttft_s < r.stats.prefill_s


def test_a_prompt_joining_a_shrunken_batch_grows_it_in_its_own_storage(pair):
    """Rows finish and leave (the storage is cut to a view), then a prompt joins: the batch grows
    back inside the target's and the draft's storage, not into new storage (a full copy of both
    caches per join), and every prompt still decodes as it does alone."""
    alone = [engine(pair).generate([p], n)[0].token_ids for p, n in ((PROMPTS[0], 3), (PROMPTS[1], 3), (PROMPTS[2], 20), (PROMPTS[3], 6))]
    eng = engine(pair)
    session = eng.session(max_rows=3)
    requests = [session.submit(PROMPTS[0], 3), session.submit(PROMPTS[1], 3), session.submit(PROMPTS[2], 20)]
    session.step()
    addresses = (eng.target.cache.storage.data_ptr(), eng.source.runner.cache.storage.data_ptr())
    while len(session.rows) == 3:
        session.step()
    left = len(session.rows)  # a short row (or both) left, the storage cut to the rows still running
    assert left < 3 and not any(r.done for r in session.rows)
    requests.append(session.submit(PROMPTS[3], 6))
    session.step()  # it joins: the batch grows by one row (6 tokens: it cannot finish in this step)
    assert any(r is requests[3] for r in session.rows)
    assert (eng.target.cache.storage.data_ptr(), eng.source.runner.cache.storage.data_ptr()) == addresses
    while not session.idle:
        session.step()
    assert [r.token_ids for r in requests] == alone


def test_a_batch_ramping_up_one_prompt_at_a_time_copies_its_caches_a_few_times(pair):
    """A server's ramp-up: prompts join one a step until `max_rows` run. The batch outgrows its
    storage at 2 rows and moves into storage laid out for 4 (twice its rows, at most max_rows), so
    the 4th prompt joins inside it, in both models' caches; every prompt decodes as it does alone."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4]]  # (PROMPTS[1] ends at its second token)
    alone = [engine(pair).generate([p], 40)[0].token_ids for p in prompts]
    eng = engine(pair)
    session = eng.session(max_rows=4)
    requests = [session.submit(prompts[0], 40)]
    moves = {"target": 0, "draft": 0}
    for prompt in prompts[1:]:
        session.step()
        before = {"target": eng.target.cache.storage, "draft": eng.source.runner.cache.storage}
        requests.append(session.submit(prompt, 40))
        session.step()  # the prompt joins (40 tokens: nobody finishes this early)
        assert not any(r.done for r in requests)
        moves["target"] += eng.target.cache.storage.data_ptr() != before["target"].data_ptr()
        moves["draft"] += eng.source.runner.cache.storage.data_ptr() != before["draft"].data_ptr()
    assert len(session.rows) == 4
    assert moves == {"target": 2, "draft": 2}  # at 2 and 3 rows (into room for 4); the 4th joined in place
    while not session.idle:
        session.step()
    assert [r.token_ids for r in requests] == alone


class _SourceWithoutRoom(ModelDraftSource):
    """A draft source written before `keep_rows` took `room`."""

    def keep_rows(self, rows: list[int]) -> None:  # type: ignore[override]
        super().keep_rows(rows)


def test_a_source_whose_keep_rows_takes_no_room_still_joins_prompts(pair):
    """`DecodeSession` passes `room` only to sources that take it (`keep_source_rows`): a source
    written before the parameter grows its batch as before, and prompts decode as alone."""
    target, draft = pair
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    alone = [engine(pair).generate([p], 30)[0].token_ids for p in prompts]
    eng = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), _SourceWithoutRoom(draft), eos_token_ids=[EOS], max_context=256)
    session = eng.session(max_rows=3)
    requests = []
    for prompt in prompts:
        requests.append(session.submit(prompt, 30))
        session.step()
    while not session.idle:
        session.step()
    assert [r.token_ids for r in requests] == alone
