"""Invariant 4: after every commit, target and draft caches equal a fresh prefill of the committed tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import sharpen, tiny_model

from specdec.drafting import ARPolicy, ChainPolicy, Eagle2Policy, StaticTreePolicy
from specdec.engine import SpeculativeEngine
from specdec.models.runner import ModelRunner, hole_filling_order
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.sources.base import AcceptedPaths, NodeBatch
from specdec.verification import GreedyRule


def committed_keys(runner: ModelRunner, row: int = 0) -> list[torch.Tensor]:
    """Per layer: the keys of the valid committed slots of `row`, [H, S_valid, D]."""
    valid = runner.slot_valid[row]
    return [layer.keys[row][:, valid] for layer in runner.cache.layers]


def fresh_keys(model, tokens: list[int]) -> list[torch.Tensor]:
    runner = ModelRunner(model)
    ids = torch.tensor([tokens])
    runner.prefill(ids, torch.ones_like(ids))
    return committed_keys(runner)


def assert_draft_cache_is_committed_minus_pending(source: ModelDraftSource, draft, committed: list[int]) -> None:
    """The draft cache (row 0) equals a fresh prefill of the committed tokens but the ones it owes,
    which are the committed tokens' tail."""
    pending = source.pending[0]
    draft_expected = committed[: len(committed) - len(pending)]
    assert committed[len(draft_expected) :] == pending
    for got, ref in zip(committed_keys(source.runner), fresh_keys(draft, draft_expected), strict=True):
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("policy", [ChainPolicy(k=4), StaticTreePolicy(depth=3, branching=2, max_nodes=10), Eagle2Policy(depth=4, top_k=3, total_tokens=10)], ids=lambda p: p.name)
@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same-weights", "other-weights"])
def test_caches_equal_fresh_prefill(arch, policy, draft_seed):
    target = sharpen(tiny_model(arch, seed=0))
    # same weights: long accepted paths, leaves get accepted; other weights: short paths, padded path columns
    draft = sharpen(tiny_model(arch, seed=draft_seed))
    prompt = [5, 6, 7, 8, 9]
    for max_new in (2, 5, 9, 14):
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
        out = engine.generate([prompt], max_new)[0]
        committed = prompt + out.token_ids[:-1]  # the last token is the pending root, cached by nobody yet
        for got, ref in zip(committed_keys(engine.target), fresh_keys(target, committed), strict=True):
            assert got.shape == ref.shape
            assert torch.allclose(got, ref, atol=1e-5)
        assert_draft_cache_is_committed_minus_pending(engine.source, draft, committed)


def test_rollback_drops_step_slots():
    model = tiny_model("llama", seed=0)
    runner = ModelRunner(model)
    ids = torch.tensor([[3, 4, 5]])
    runner.prefill(ids, torch.ones_like(ids))
    before = [k.clone() for k in committed_keys(runner)]
    runner.forward(torch.tensor([[6, 7]]), torch.tensor([[3, 4]]), torch.ones(1, 2, 2, dtype=torch.bool))
    runner.rollback()
    assert runner.step_len == 0
    for got, ref in zip(committed_keys(runner), before, strict=True):
        assert torch.equal(got, ref)


def test_compaction_keeps_positions_and_values():
    """Holes left by padding are removed without changing any row's committed keys."""
    model = tiny_model("llama", seed=0)
    runner = ModelRunner(model)
    ids = torch.tensor([[0] * 70 + [3, 4, 5], list(range(3, 76))])
    mask = torch.ones_like(ids)
    mask[0, :70] = 0
    runner.prefill(ids, mask)
    assert runner.past_len == 73
    before = [committed_keys(runner, r) for r in range(2)]
    # commit a step where row 0 keeps 1 slot and row 1 keeps none (padding) repeatedly
    for _ in range(3):
        runner.forward(torch.tensor([[9], [9]]), runner.committed_len()[:, None], torch.ones(2, 1, 1, dtype=torch.bool))
        runner.commit(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[True], [False]]))
    runner.compact_if_wasteful(max_waste=0.0, min_slots=1)
    assert runner.past_len == 73  # row 1 has 73 valid slots, row 0 has 3 + 3
    for r in range(2):
        for got, ref in zip(committed_keys(runner, r), before[r], strict=True):
            assert torch.allclose(got[:, : ref.shape[1]], ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compaction_moves_only_the_slots_from_the_first_hole_on(arch):
    """Rows of different prompt lengths (left padding) whose steps keep different counts (holes
    after the prompts): compaction packs the slots from the first hole on, in place, and leaves
    the prompts' slots where they are. Every row keeps its committed keys in order, its position
    ids, and the next forward's logits equal those of the same runner never compacted."""
    model = tiny_model(arch, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :25] = 0  # row 0: a 15-token prompt, left-padded
    mask[2, :5] = 0
    runners = [ModelRunner(model), ModelRunner(model)]
    for runner in runners:
        runner.prefill(ids, mask)
    runners[1].compact_if_wasteful = lambda *args, **kwargs: None  # the reference never compacts
    for step in range(24):  # 4 step slots a row; each row keeps a different prefix of them
        tokens = torch.randint(3, 60, (3, 4), generator=gen)
        kept = torch.randint(1, 5, (3,), generator=gen)
        for runner in runners:
            positions = runner.committed_len()[:, None] + torch.arange(4)[None, :]
            runner.forward(tokens, positions, torch.ones(4, 4, dtype=torch.bool).tril()[None].expand(3, 4, 4))
            runner.commit(torch.arange(4)[None, :].expand(3, 4), torch.arange(4)[None, :] < kept[:, None])
        if step == 11:
            compacted = runners[0]
            prompt_slots = [t.narrow(slot, 0, 40).clone() for t, _, slot in compacted.cache.tensors()]
            before = [committed_keys(compacted, r) for r in range(3)]
            lengths = compacted.committed_len().clone()
            width = compacted.past_len
            compacted.compact_if_wasteful(max_waste=0.0, min_slots=1)
            assert compacted.past_len < width  # holes were removed ...
            assert compacted.past_len == 40 + int((compacted.slot_valid[:, 40:]).sum(dim=1).max())  # ... behind the prompts
            for (t, _, slot), kept_prompt in zip(compacted.cache.tensors(), prompt_slots, strict=True):
                assert torch.equal(t.narrow(slot, 0, 40), kept_prompt)  # the prompts' slots did not move
            assert torch.equal(compacted.committed_len(), lengths)
            for r in range(3):
                for got, ref in zip(committed_keys(compacted, r), before[r], strict=True):
                    assert torch.equal(got, ref)
    tokens = torch.randint(3, 60, (3, 2), generator=gen)
    logits = []
    for runner in runners:
        positions = runner.committed_len()[:, None] + torch.arange(2)[None, :]
        logits.append(runner.forward(tokens, positions, torch.ones(2, 2, dtype=torch.bool).tril()[None].expand(3, 2, 2)))
    assert runners[0].past_len < runners[1].past_len
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_commit_with_padding_columns_at_a_full_cache():
    """A commit may keep more columns than the step forwarded, the extra ones padding (a chain's
    path column for the leaf the draft never forwarded): when the step filled the cache to its
    capacity, the commit grows it instead of failing, and the committed keys are the valid ones."""
    model = tiny_model("llama", seed=0)
    runner = ModelRunner(model)
    tokens = [3 + i % 50 for i in range(6)]
    runner.prefill(torch.tensor([tokens]), torch.ones(1, 6, dtype=torch.long))
    capacity = runner.cache.capacity
    fill = [7 + i % 40 for i in range(capacity - 6 - 6)]  # one step up to 6 slots short of the capacity, all kept
    n = len(fill)
    runner.forward(torch.tensor([fill]), (6 + torch.arange(n))[None], torch.ones(n, n, dtype=torch.bool).tril()[None])
    runner.commit(torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))
    last = [11, 12, 13, 14, 15, 16]
    base = runner.past_len
    runner.forward(torch.tensor([last]), (base + torch.arange(6))[None], torch.ones(6, 6, dtype=torch.bool).tril()[None])
    assert runner.past_len + runner.step_len == capacity
    keep = torch.tensor([[0, 1, 2, 3, 4, 5, 0]])  # 7 columns after a 6-slot step: the last is padding
    runner.commit(keep, torch.tensor([[True] * 6 + [False]]))
    assert runner.cache.capacity > capacity
    for got, ref in zip(committed_keys(runner), fresh_keys(model, tokens + fill + last), strict=True):
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-5)


def test_chain_decodes_past_the_draft_cache_capacity():
    """Regression: a K = 5 chain whose draft step (pending token, root, 4 forwarded nodes) ends
    exactly at the draft cache's capacity commits 7 columns: it failed with 'start + length
    exceeds dimension size'. With the draft equal to the target every step commits 6 tokens, so
    6 consecutive prompt lengths meet every alignment with the capacity; each decodes past it
    and equals AR's output."""
    model = sharpen(tiny_model("llama", seed=0))
    for length in range(250, 256):  # caches of 512 slots (the prompt + 256, rounded up), filled after ~256 new tokens
        prompt = [5 + i % 60 for i in range(length)]
        want = SpeculativeEngine(model, ARPolicy(), GreedyRule(), None, eos_token_ids=[]).generate([prompt], 270)[0].token_ids
        chain = SpeculativeEngine(model, ChainPolicy(k=5), GreedyRule(), ModelDraftSource(model), eos_token_ids=[])
        assert chain.generate([prompt], 270)[0].token_ids == want


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_keep_rows_hole_filling_equals_a_full_gather(arch):
    """Rows finishing: keeping rows in hole-filling order (a host list: the moved rows are copied,
    the storage cut to a view) leaves the same caches as a full gather, and the next forward and
    commit give the same logits and keys."""
    model = tiny_model(arch, seed=0)
    ids = torch.tensor([[3 + r, 4, 5 + r, 6, 7 + 2 * r] for r in range(6)])
    finished = [False, True, False, True, False, False]
    order = hole_filling_order(finished)
    assert order == [0, 4, 2, 5]
    runners = []
    for how in ("list", "tensor"):
        runner = ModelRunner(model)
        runner.prefill(ids, torch.ones_like(ids))
        runner.keep_rows(order if how == "list" else torch.tensor(order))
        runners.append(runner)
    fast, full = runners
    assert fast.cache.rows == full.cache.rows == 4
    for r in range(4):
        for got, ref in zip(committed_keys(fast, r), committed_keys(full, r), strict=True):
            assert torch.equal(got, ref)
    step = torch.tensor([[11], [12], [13], [14]])
    outs = [runner.forward(step, runner.committed_len()[:, None], torch.ones(4, 1, 1, dtype=torch.bool)) for runner in runners]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    for runner in runners:
        runner.commit(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool))
    for r in range(4):
        for got, ref in zip(committed_keys(fast, r), committed_keys(full, r), strict=True):
            assert torch.equal(got, ref)
    # a row in hole-filling order really holds the row it names: the filled row 1 is the old row 4
    solo = ModelRunner(model)
    solo.prefill(ids[4:5], torch.ones(1, 5, dtype=torch.long))
    solo_out = solo.forward(step[1:2], solo.committed_len()[:, None], torch.ones(1, 1, 1, dtype=torch.bool))
    assert torch.allclose(outs[0][1], solo_out[0], atol=1e-5)


class _Deferring:
    """Wraps a policy: drafts nothing (`DraftSource.defer`) at the steps `pattern` marks."""

    uses_draft = True

    def __init__(self, inner, pattern) -> None:
        self.inner, self.pattern, self.name, self.step, self.refused = inner, pattern, inner.name, 0, 0

    def draft(self, source, roots, ctx):
        from specdec.drafting.builder import root_only_draft

        skip = self.pattern(self.step)
        self.step += 1
        if skip:
            if source.defer(roots):
                return root_only_draft(roots)
            self.refused += 1
        return self.inner.draft(source, roots, ctx)

    def feedback(self, record) -> None:
        self.inner.feedback(record)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("pattern", [lambda s: s % 3 != 2, lambda s: s % 2 == 0, lambda s: s < 7], ids=["two-of-three", "alternate", "first-seven"])
def test_deferred_steps_keep_caches_and_output(arch, pattern):
    """Steps that draft nothing leave the draft owing their roots; the next drafted step forwards
    them all (several pending tokens per row, different counts per row): the draft cache then
    equals a fresh prefill of the committed tokens minus the pending ones, and greedy output
    is the target's own, in a batch of unequal prompts."""
    target = sharpen(tiny_model(arch, seed=0))
    draft = sharpen(tiny_model(arch, seed=0))  # same weights: long accepted paths, accepted leaves become pending
    prompts = [[5, 6, 7, 8, 9], [11, 3, 4], [2, 9, 8, 7, 6, 5, 4]]
    reference = SpeculativeEngine(target, ChainPolicy(k=1), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[]).generate(prompts, 16)
    from specdec.drafting.policies import ARPolicy

    ar = SpeculativeEngine(target, ARPolicy(), GreedyRule(), None, eos_token_ids=[]).generate(prompts, 16)
    assert [o.token_ids for o in reference] == [o.token_ids for o in ar]
    for inner in (ChainPolicy(k=3), Eagle2Policy(depth=3, top_k=2, total_tokens=6)):
        policy = _Deferring(inner, pattern)
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
        out = engine.generate(prompts, 16)
        assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    # one prompt alone, checked cache against cache (rows of a finished batch retire)
    for inner in (ChainPolicy(k=3), Eagle2Policy(depth=3, top_k=2, total_tokens=6)):
        for max_new in (3, 8, 13):
            engine = SpeculativeEngine(target, _Deferring(inner, pattern), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
            out = engine.generate([prompts[0]], max_new)[0]
            committed = prompts[0] + out.token_ids[:-1]
            assert_draft_cache_is_committed_minus_pending(engine.source, draft, committed)


def test_defer_refused_past_max_pending():
    """A source owing `max_pending` tokens refuses to defer: the policy drafts, and the debt is paid."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=1))
    source = ModelDraftSource(draft)
    source.max_pending = 3
    policy = _Deferring(ChainPolicy(k=2), lambda s: True)
    engine = SpeculativeEngine(target, policy, GreedyRule(), source, eos_token_ids=[])
    ar = SpeculativeEngine(target, ChainPolicy(k=1), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[]).generate([[5, 6, 7]], 12)
    out = engine.generate([[5, 6, 7]], 12)
    assert out[0].token_ids == ar[0].token_ids
    assert policy.refused >= 2  # every third step had to draft
    assert len(source.pending[0]) <= 3


def test_owed_tokens_forwarded_whatever_the_slots_held_before():
    """The step after deferred steps lays its pending and root slots out afresh: slots that held
    invalid tree nodes at an earlier step (here: every slot marked invisible) must not hide the
    owed tokens or the root. The root's distribution equals a fresh forward of the whole sequence."""
    draft = sharpen(tiny_model("llama", seed=1))
    source = ModelDraftSource(draft)
    prompt = torch.tensor([[5, 6, 7, 8]])
    source.prefill(prompt, torch.ones_like(prompt))
    params = SamplingParams()
    source.begin_step(torch.tensor([9]), params)  # a step whose slots are then dropped
    source.runner.rollback()
    source._slot_ok.fill_(False)  # as if every slot had held an invalid node ...
    source._slot_node.fill_(1)  # ... numbered like the node accepted below
    for root in (9, 10):
        assert source.defer(torch.tensor([root]))
        source.end_step(None)  # a deferred step's verdict holds nothing
    assert source.pending == [[9, 10]]
    got = source.begin_step(torch.tensor([11]), params)  # [1, V]
    with torch.no_grad():
        ref = torch.log_softmax(draft(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])).logits[0, -2:].float(), dim=-1)  # [2, V]
    assert torch.allclose(got[0], ref[0], atol=1e-4)
    # a child of the root sees the owed tokens and the root
    child = NodeBatch(
        nodes=torch.tensor([[1]]),
        valid=torch.tensor([[True]]),
        tokens=torch.tensor([[11, 12]]),
        depths=torch.tensor([[0, 1]]),
        ancestors=torch.tensor([[[True, False], [True, True]]]),
        depth=1,
    )
    assert torch.allclose(source.expand(child, params)[0, 0], ref[1], atol=1e-4)
    # accepting the child keeps the owed tokens, the root and the child's own slot, once each
    source.end_step(AcceptedPaths(torch.tensor([[1]]), torch.tensor([1]), child.tokens, [[12]], [True], None))
    assert source.pending == [[]]
    for got_keys, ref_keys in zip(committed_keys(source.runner), fresh_keys(draft, [5, 6, 7, 8, 9, 10, 11, 12]), strict=True):
        assert got_keys.shape == ref_keys.shape
        assert torch.allclose(got_keys, ref_keys, atol=1e-5)


@pytest.mark.parametrize("pattern", [lambda s: s % 3 != 2, lambda s: s % 2 == 0], ids=["two-of-three", "alternate"])
def test_deferred_steps_in_a_rolling_batch(pattern):
    """Rows that owe pending tokens while other rows finish and new prompts take their places
    (`replace_rows`, `prefill_rows` of the draft): greedy output is still the target's own."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=0))
    prompts = [[5, 6, 7, 8, 9], [11, 3, 4], [2, 9, 8, 7, 6, 5, 4], [3, 3], [7, 1, 2, 9]]
    from specdec.drafting.policies import ARPolicy

    ar = SpeculativeEngine(target, ARPolicy(), GreedyRule(), None, eos_token_ids=[]).generate(prompts, 12)
    stop_at = [4, 12, 7, 12, 9]  # rows end at different steps, so new prompts join rows that owe tokens beside them
    expected = [o.token_ids[: stop_at[i]] for i, o in enumerate(ar)]
    for inner in (ChainPolicy(k=3), Eagle2Policy(depth=3, top_k=2, total_tokens=6)):
        policy = _Deferring(inner, pattern)
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
        seen = [0] * len(prompts)

        def stop(index: int, tokens: list[int], seen: list[int] = seen) -> bool:  # tokens: this step's new ones
            seen[index] += len(tokens)
            return seen[index] >= stop_at[index]

        out = engine.generate(prompts, 12, batch_size=2, stop=stop)
        assert [o.token_ids[: stop_at[i]] for i, o in enumerate(out)] == expected
        assert [o.finish_reason for o in out] == ["stop", "length", "stop", "length", "stop"]
        assert policy.step > 0


@pytest.mark.parametrize("source_kind", ["ensemble", "lookup"])
def test_deferred_steps_with_other_draft_sources(source_kind):
    """CAST's plain steps (on by default) defer through every draft source: the TABED ensemble
    (its views' draft owes the roots) and n-gram lookup (the roots join its history). Greedy
    output is the target's own at batch size 3 (the fourth prompt joins when a row frees), whatever
    the pattern of deferred steps; lookup's history, and the ensemble's pass-through draft cache with
    the tokens it owes, hold every committed token, deferred roots included."""
    from specdec.multimodal.views import PassThroughView, TruncatedView
    from specdec.sources.ensemble import EnsembleConfig, EnsembleDraftSource
    from specdec.sources.lookup import LookupDraftSource

    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=0))
    prompts = [[5, 6, 7, 5, 6, 7, 5], [11, 3, 4], [2, 9, 8, 7, 6, 5, 4], [3, 3, 3]]
    ar = SpeculativeEngine(target, ARPolicy(), GreedyRule(), None, eos_token_ids=[]).generate(prompts, 14)
    for pattern in (lambda s: s % 3 != 2, lambda s: s % 2 == 0, lambda s: s < 5):
        if source_kind == "ensemble":
            source = EnsembleDraftSource(draft, [PassThroughView(), TruncatedView(3)], EnsembleConfig(policy="softmax"))
        else:
            source = LookupDraftSource(vocab_size=target.config.vocab_size)
        policy = _Deferring(ChainPolicy(k=3), pattern)
        out = SpeculativeEngine(target, policy, GreedyRule(), source, eos_token_ids=[]).generate(prompts, 14, batch_size=3)
        assert [o.token_ids for o in out] == [o.token_ids for o in ar]
        assert sum(o.stats.accepted_tokens for o in out) > 0  # drafted steps after deferred ones still propose accepted tokens
        # one prompt alone: what the source holds is every committed token, deferred roots included
        one = SpeculativeEngine(target, _Deferring(ChainPolicy(k=3), pattern), GreedyRule(), source, eos_token_ids=[]).generate(prompts[:1], 14)[0]
        committed = prompts[0] + one.token_ids[:-1]  # the last token is the next root, held by nobody yet
        if source_kind == "lookup":
            assert source.history[0] == committed
        else:  # the views' draft, row 0 = the pass-through view: its cache is the committed tokens minus the owed ones
            assert_draft_cache_is_committed_minus_pending(source.inner, draft, committed)


def test_draft_root_forward_runs_its_lm_head_on_the_root_alone():
    """The draft's forward of the owed tokens and the root reads the root's logits only, so its LM
    head sees one position per row, after one pending token or a catch-up of several (a small
    draft's head can cost more than its layers); greedy output is still the target's own."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=0))
    head_positions: list[int] = []
    draft.get_output_embeddings().register_forward_hook(lambda module, args, out: head_positions.append(args[0].shape[1]))
    source = ModelDraftSource(draft)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 4]]
    engine = SpeculativeEngine(target, _Deferring(ChainPolicy(k=1), lambda s: s % 4 != 3), GreedyRule(), source, eos_token_ids=[])
    from specdec.drafting.policies import ARPolicy

    ar = SpeculativeEngine(target, ARPolicy(), GreedyRule(), None, eos_token_ids=[]).generate(prompts, 16)
    head_positions.clear()
    out = engine.generate(prompts, 16)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    # chain k=1 drafts no level below the root: every head call is a root forward (prefill keeps one too)
    assert head_positions and set(head_positions) == {1}


def test_latent_attention_cache_is_one_storage_and_commits_right():
    """DeepSeek-V3's layers cache a 16-wide latent as keys and an 8-wide rotary key as values. All
    its layers share one storage (a commit is one gather for all of them, not one per layer), each
    seeing views of its own widths, and after decoding the committed latents equal a fresh prefill's."""
    from conftest import tiny_any_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_any_config("deepseek_v3", layers=4)).eval()
    engine = SpeculativeEngine(model, Eagle2Policy(depth=4, top_k=3, total_tokens=10), GreedyRule(), ModelDraftSource(model), eos_token_ids=[])
    prompt = [5, 6, 7, 8, 9]
    out = engine.generate([prompt], 9)[0]
    cache = engine.target.cache
    assert len(cache.tensors()) == 1 and cache.layout == (1, 16, 1, 8)
    keys, values = cache.kv(0)
    assert (keys.shape[1], keys.shape[3], values.shape[1], values.shape[3]) == (1, 16, 1, 8)
    committed = prompt + out.token_ids[:-1]
    for got, ref in zip(committed_keys(engine.target), fresh_keys(model, committed), strict=True):
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5)


def test_a_longer_prompt_joins_without_moving_the_other_rows():
    """`replace_rows` with a prompt longer than the cache's width grows it on the right: the other
    rows' committed slots stay where they were (holes after them, masked), and the new row's cache
    and next-token logits equal a fresh prefill of its prompt."""
    model = tiny_model("llama", seed=0)
    runner = ModelRunner(model)
    ids = torch.tensor([[5, 6, 7], [1, 2, 3]])
    runner.prefill(ids, torch.ones_like(ids))
    width = runner.past_len
    before_valid = runner.slot_valid[0].clone()
    before_keys = [layer.keys[0][:, :width].clone() for layer in runner.cache.layers]
    long_prompt = [9, 8, 7, 6, 5, 4, 3, 2]
    logits = runner.replace_rows([1], torch.tensor([long_prompt]), torch.ones(1, len(long_prompt), dtype=torch.long))
    assert runner.past_len == len(long_prompt)
    assert torch.equal(runner.slot_valid[0, :width], before_valid) and not runner.slot_valid[0, width:].any()
    for layer, keys in zip(runner.cache.layers, before_keys, strict=True):
        assert torch.equal(layer.keys[0][:, :width], keys)  # row 0 did not move
    for got, ref in zip(committed_keys(runner, row=1), fresh_keys(model, long_prompt), strict=True):
        assert torch.allclose(got, ref, atol=1e-5)
    with torch.no_grad():
        ref_logits = model(torch.tensor([long_prompt])).logits[0, -1].float()
    assert torch.allclose(logits[0].float(), ref_logits, atol=1e-4)
    assert runner.committed_len().tolist() == [3, len(long_prompt)]


def test_shorter_prompts_replace_rows_in_place_and_leave_the_others_alone():
    """`replace_rows` with prompts shorter than the cache's width writes each new row's slots in
    place: zeros (invalid) before its prompt, the prompt's keys right-aligned, and nothing of the
    rows it does not replace changes, whichever rows it replaces and in what order."""
    model = tiny_model("llama", seed=0)
    runner = ModelRunner(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]])
    runner.prefill(ids, torch.ones_like(ids))
    width = runner.past_len
    kept_keys = [layer.keys[1][:, :width].clone() for layer in runner.cache.layers]
    prompts = [[9, 8], [4, 3, 2, 1]]  # into rows 2 and 0, in that order
    ids, mask = torch.tensor([[0, 0, 9, 8], [4, 3, 2, 1]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    logits = runner.replace_rows([2, 0], ids, mask)
    assert runner.past_len == width and runner.committed_len().tolist() == [4, 6, 2]
    for layer, keys in zip(runner.cache.layers, kept_keys, strict=True):
        assert torch.equal(layer.keys[1][:, :width], keys)
    for row, prompt, row_logits in ((2, prompts[0], logits[0]), (0, prompts[1], logits[1])):
        assert not runner.slot_valid[row, : width - len(prompt)].any() and runner.slot_valid[row, width - len(prompt) :].all()
        for layer in runner.cache.layers:
            assert not layer.keys[row][:, : width - len(prompt)].any()  # the old row's slots are gone
        for got, ref in zip(committed_keys(runner, row=row), fresh_keys(model, prompt), strict=True):
            assert torch.allclose(got, ref, atol=1e-5)
        with torch.no_grad():
            ref_logits = model(torch.tensor([prompt])).logits[0, -1].float()
        assert torch.allclose(row_logits.float(), ref_logits, atol=1e-4)


def test_when_every_row_finishes_at_once_the_waiting_prompts_start_a_new_batch(monkeypatch):
    """A rolling batch whose rows all finish in one step (AR: every row one token a step) starts a
    new batch for the waiting prompts (one prefill into a cache as wide as they need) rather than
    splicing them into the old cache (`replace_rows`), whose width its longest row set. Outputs are
    each prompt's own."""
    target = tiny_model("llama", seed=0)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [11, 3, 4, 5, 6, 7, 8, 9, 10, 2], [2, 9], [3, 3, 1]]
    engine = SpeculativeEngine(target, ARPolicy(), GreedyRule(), None, eos_token_ids=[])
    alone = [engine.generate([p], 5)[0].token_ids for p in prompts]
    calls = {"prefill": 0, "replace_rows": 0}
    widths: list[int] = []
    for name in calls:
        original = getattr(ModelRunner, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            out = _original(self, *args, **kwargs)
            widths.append(self.past_len)
            return out

        monkeypatch.setattr(ModelRunner, name, counted)
    out = engine.generate(prompts, 5, batch_size=2)
    assert [o.token_ids for o in out] == alone
    assert calls == {"prefill": 2, "replace_rows": 0}
    assert widths == [12, 3]  # the second batch's cache is as wide as its own prompts


@pytest.mark.parametrize("arch", ["llama", "gpt2", "deepseek_v3"])
def test_a_batch_that_shrank_grows_back_in_its_own_storage(arch):
    """Rows finishing cut the storage to a view of its first rows; prompts joining later (an order
    that keeps every row and appends rows, as `DecodeSession._fill_rows` asks) widen the view over
    the rows left behind, copying only the appended rows: no new storage (the full gather copied
    the whole cache, 29-359 ms a join on the CPU for the bundled target), and the same caches,
    logits and commits as a full gather. Growth past the rows the storage was laid out for falls
    back to the full gather. DeepSeek-V3: keys and values of different shapes in one storage."""
    from conftest import tiny_any_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = tiny_model(arch, seed=0) if arch != "deepseek_v3" else AutoModelForCausalLM.from_config(tiny_any_config(arch)).eval()
    ids = torch.tensor([[3 + r, 4, 5 + r, 6, 7 + 2 * r] for r in range(6)])
    runners, addresses = [], []
    for how in ("list", "tensor"):
        runner = ModelRunner(model)
        runner.prefill(ids, torch.ones_like(ids))
        runner.keep_rows(hole_filling_order([False, True, False, True, False, False]))  # 4 rows: [0, 4, 2, 5]
        address = runner.cache.storage.data_ptr()
        grow = [0, 1, 2, 3, 1, 0]  # two rows join (copies of rows 1 and 0 until their prefill)
        runner.keep_rows(grow if how == "list" else torch.tensor(grow))
        assert runner.cache.rows == 6 and runner.slot_valid.shape[0] == 6
        assert (runner.cache.storage.data_ptr() == address) == (how == "list")  # the list grows in place
        runners.append(runner)
        addresses.append(address)
    fast, full = runners
    for r in range(6):
        for got, ref in zip(committed_keys(fast, r), committed_keys(full, r), strict=True):
            assert torch.equal(got, ref)
    step = torch.tensor([[11], [12], [13], [14], [15], [16]])
    outs = [runner.forward(step, runner.committed_len()[:, None], torch.ones(6, 1, 1, dtype=torch.bool)) for runner in runners]
    assert torch.equal(outs[0], outs[1])
    for runner in runners:
        runner.commit(torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1, dtype=torch.bool))
    for r in range(6):
        for got, ref in zip(committed_keys(fast, r), committed_keys(full, r), strict=True):
            assert torch.equal(got, ref)
    # past the 6 rows the storage was laid out for: a new storage, the same contents
    old_storage = fast.cache.storage  # (alive: the new storage cannot take its address)
    fast.keep_rows([0, 1, 2, 3, 4, 5, 2])
    assert fast.cache.rows == 7 and fast.cache.storage.data_ptr() != old_storage.data_ptr() == addresses[0]
    for got, ref in zip(committed_keys(fast, 6), committed_keys(full, 2), strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_batch_growing_past_its_storage_moves_into_storage_with_room(arch):
    """A batch that grows past every size it had (a server ramping up, one prompt joining at a
    time), given the most rows it may reach (`room`), moves into storage laid out for twice its
    rows, at most `room`: the next joins grow in place, and caches, logits and commits equal those
    of full gathers. Without `room` every such growth gathers (the rows exactly)."""
    from conftest import tiny_any_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = tiny_model(arch, seed=0) if arch != "deepseek_v3" else AutoModelForCausalLM.from_config(tiny_any_config(arch)).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    roomy, exact, full = ModelRunner(model), ModelRunner(model), ModelRunner(model)
    for runner in (roomy, exact, full):
        runner.prefill(ids, torch.ones_like(ids))
    layouts, moves = [], 0
    for rows in range(3, 8):  # 2 -> 7 rows, one joining at a time (a copy of row 1 until its prefill)
        order = [*range(rows - 1), 1]
        before = roomy.cache.storage
        roomy.keep_rows(order, room=7)
        exact.keep_rows(order)
        full.keep_rows(torch.tensor(order))  # a tensor order: always the full gather
        moves += roomy.cache.storage.data_ptr() != before.data_ptr()
        storage = roomy.cache.storage  # [L, 2, B, H, capacity, D], a view of the first B rows of its layout
        layouts.append(storage.stride(1) // storage.stride(2))
        assert roomy.cache.rows == exact.cache.rows == rows
        del before
    assert layouts == [4, 4, 7, 7, 7]  # laid out for 2 x 2 rows, then for min(7, 2 x 4)
    assert moves == 2  # at 3 and 5 rows; 4, 6 and 7 grew in place
    assert exact.cache.storage.shape[2] == 7  # no room: exactly the rows
    for r in range(7):
        for got, ref in zip(committed_keys(roomy, r), committed_keys(full, r), strict=True):
            assert torch.equal(got, ref)
    step = torch.arange(11, 18)[:, None]
    outs = [runner.forward(step, runner.committed_len()[:, None], torch.ones(7, 1, 1, dtype=torch.bool)) for runner in (roomy, full)]
    assert torch.equal(outs[0], outs[1])
    for runner in (roomy, full):
        runner.commit(torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1, dtype=torch.bool))
    for r in range(7):
        for got, ref in zip(committed_keys(roomy, r), committed_keys(full, r), strict=True):
            assert torch.equal(got, ref)


def test_a_cut_view_widens_only_over_rows_its_storage_lays_out():
    """`_widened` widens a cut of the batch dimension within the rows the storage holds in that
    layout, and refuses a widening that would address an element twice (another dimension's data
    interleaved after the rows) or reach past the storage."""
    from specdec.models.runner import _widened

    base = torch.arange(3 * 2 * 8 * 4 * 5, dtype=torch.float32).reshape(3, 2, 8, 4, 5)  # [L, 2, B, H, D], laid out for 8 rows
    wide = _widened(base.narrow(2, 0, 5), 2, 8)
    assert wide is not None and torch.equal(wide, base)  # the rows the cut left behind, in place
    assert _widened(base.narrow(2, 0, 5), 2, 9) is None  # past the layout's 8 rows
    heads_outside = torch.zeros(3, 2, 4, 8, 5).permute(0, 1, 3, 2, 4)  # rows inside the heads' stride: stride(1) / stride(2) = 32
    assert _widened(heads_outside.narrow(2, 0, 5), 2, 8) is not None
    assert _widened(heads_outside.narrow(2, 0, 5), 2, 9) is None  # row 8 would be the next head's row 0
    assert _widened(torch.zeros(8, 3)[:5], 0, 6) is None  # a batch dimension first: no layout to read
