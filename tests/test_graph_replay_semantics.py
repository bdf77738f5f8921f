"""CUDA-graph replay semantics, checked on the CPU.

A CUDA graph records the kernels of one forward with every host value of that call baked in
(a Python int that picks a slice, a tensor made from a list) and, on replay, re-reads only the
memory it recorded. So a static-shape forward is safe to graph only if everything that changes
between calls with the same graph key lives in the fixed buffers. The CUDA tests check replay on
a GPU; here `make_fx` gives the same semantics on the CPU: the first forward of each key is
traced (host values become constants, tensors are kept by reference) and later forwards replay
the trace on the same buffers. Greedy output under emulated replay must equal `generate`'s for
every method; a deliberately unsafe buffer (token ids in a new tensor each call) must fail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import EOS, cast_level_options, close_pair, sharpen, tiny_any_config, tiny_model
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import AutoModelForCausalLM

from specdec.cost import CostTable
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.models import static
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule
from specdec.verification.sampling import SamplingRule

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47], [20, 21]]
METHODS = {
    "ar": {},
    "chain": {"k": 4},
    "static": {"depth": 3, "branching": 2, "max_nodes": 12},
    "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10},
    "dynatree": {"max_nodes": 12},
    "dynatree-free": {"free_tokens": 24},  # CUDA's default rules: the free width (7 draft tokens a row at B = 3)
    # plain steps off: the wall-clock check would rightly go plain under the slow emulated replays
    # (the synthetic table's 10 ms plain step against traced draft forwards), and the draft must replay here
    "cast": {"cost_table": CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n), "plain_steps": False},
}


def policy(label: str) -> Any:
    """The policy of a METHODS entry (a method name, or method-variant)."""
    return make_policy(label.split("-")[0], **METHODS[label])


class ReplayEmulator:
    """Stands in for `CudaGraphRunner` on the CPU: capture = a make_fx trace of the call, replay =
    running the trace (host values as traced, buffers as they are now)."""

    def __init__(self) -> None:
        self.traces: dict[tuple[Any, ...], Any] = {}
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None

    def clear(self) -> None:
        self.traces.clear()

    def run(self, key: tuple[Any, ...], call: Callable[[], torch.Tensor], keepalive: Any) -> torch.Tensor:
        trace = self.traces.get(key)
        if trace is None:
            trace = self.traces[key] = (make_fx(call, tracing_mode="real")(), keepalive)
            self.captures += 1
        else:
            self.replays += 1
        return trace[0]()


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def emulated_engine(target, draft, method: str, rule: Any = None) -> tuple[SpeculativeEngine, list[ReplayEmulator]]:
    source = ModelDraftSource(draft, static_shapes=True)
    engine = SpeculativeEngine(target, policy(method), rule or GreedyRule(), source, eos_token_ids=[EOS], static_shapes=True)
    emulators = [ReplayEmulator(), ReplayEmulator()]
    engine.target.graphs, source.runner.graphs = emulators
    return engine, emulators


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2", "qwen2"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_under_emulated_graph_replay_equals_generate(arch, method):
    target, draft = close_pair(arch)
    refs = [reference(target, p, 32) for p in PROMPTS]
    engine, emulators = emulated_engine(target, draft, method)
    outs = engine.generate(PROMPTS, 32, batch_size=3)
    assert [o.token_ids for o in outs] == refs
    assert emulators[0].captures > 0 and emulators[0].replays > 0, "the target's forwards must replay traces"
    if method != "ar":
        assert emulators[1].replays > 0, "the draft's forwards must replay traces"


def decode_logits(runner: ModelRunner, steps: int = 6) -> torch.Tensor:
    """Prefill two left-padded rows, then `steps` one-token steps (each committed): [2, steps, V]."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    runner.prefill(ids, (ids > 0).long().index_fill_(0, torch.tensor([1]), 1))
    token, out = torch.tensor([[9], [10]]), []
    for _ in range(steps):
        logits = runner.forward(token, runner.committed_len()[:, None], torch.ones(2, 1, 0, dtype=torch.bool))
        runner.commit(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool))
        out.append(logits)
        token = logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("unsafe", [False, True], ids=["buffers", "positions-outside-the-buffers"])
def test_replay_reads_every_input_from_the_buffers(unsafe, monkeypatch):
    """Replayed one-token steps equal eager ones; and the check can fail: position ids copied into
    a new tensor each call (outside the fixed buffers, and not in the graph key) are baked into the
    first trace, so later replays run at stale positions."""
    if unsafe:
        fill = static.StaticInputs.fill

        def unsafe_fill(self, input_ids, position_ids, *args):
            fill(self, input_ids, position_ids, *args)
            self.position_ids = self.position_ids.clone()

        monkeypatch.setattr(static.StaticInputs, "fill", unsafe_fill)
    model = sharpen(tiny_model("gpt2", seed=0))
    eager = decode_logits(ModelRunner(model, static_shapes=True))
    replayed_runner = ModelRunner(model, static_shapes=True)
    emulator = replayed_runner.graphs = ReplayEmulator()
    replayed = decode_logits(replayed_runner)
    assert emulator.replays >= 4
    worst = (replayed - eager).abs().max().item()
    if unsafe:
        assert worst > 1e-3
    else:
        assert worst < 1e-5


@pytest.mark.parametrize("method", ["chain", "eagle2", "dynatree", "dynatree-free"])
def test_sampled_output_under_emulated_replay_equals_eager(method):
    """Sampling (T = 0.8, top-p 0.9, one seed): replayed forwards give the same draws as eager ones."""
    target, draft = close_pair("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9)
    engine, emulators = emulated_engine(target, draft, method, rule=SamplingRule())
    replayed = [o.token_ids for o in engine.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)]
    eager_source = ModelDraftSource(draft, static_shapes=True)
    eager = SpeculativeEngine(target, policy(method), SamplingRule(), eager_source, eos_token_ids=[EOS], static_shapes=True)
    assert replayed == [o.token_ids for o in eager.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)]
    assert emulators[0].replays > 0 and emulators[1].replays > 0


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("method", ["chain", "eagle2", "dynatree"])
def test_sliding_window_models_replay_exactly(model_type, method):
    """Sliding windows (8 slots; every layer, or mixed with full layers) in static shapes under
    emulated replay: the window mask is a buffer too, so replays see each step's window."""
    torch.manual_seed(0)
    target = sharpen(AutoModelForCausalLM.from_config(tiny_any_config(model_type)).eval())
    torch.manual_seed(0)
    draft = sharpen(AutoModelForCausalLM.from_config(tiny_any_config(model_type)).eval())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    refs = [reference(target, p, 32) for p in PROMPTS]
    engine, emulators = emulated_engine(target, draft, method)
    assert engine.target.static_shapes
    assert [o.token_ids for o in engine.generate(PROMPTS, 32, batch_size=3)] == refs
    assert emulators[0].replays > 0 and emulators[1].replays > 0


@pytest.mark.parametrize("method", ["chain", "eagle2"])
def test_vision_language_pair_replays_exactly(lvlm, method):
    """A LLaVA target and draft (images in the prompts, batched and rolling): prefills with images
    run eagerly, every decoding forward replays; greedy output equals the target's generate."""
    eos = lvlm["tok"].eos_token_id
    refs = []
    for prompt in lvlm["prompts"]:
        ids = torch.tensor([list(prompt)])
        extra = getattr(prompt, "model_inputs", None) or {}
        with torch.no_grad():
            out = lvlm["target"].generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=1)
        refs.append(out[0, ids.shape[1] :].tolist())
    source = ModelDraftSource(lvlm["draft"], static_shapes=True)
    engine = SpeculativeEngine(lvlm["target"], policy(method), GreedyRule(), source, eos_token_ids=[eos], pad_token_id=1, static_shapes=True)
    engine.target.graphs, source.runner.graphs = emulators = [ReplayEmulator(), ReplayEmulator()]
    for batch_size in (None, 2):
        assert [o.token_ids for o in engine.generate(lvlm["prompts"], 16, batch_size=batch_size)] == refs, f"batch_size={batch_size}"
    assert emulators[0].replays > 0 and emulators[1].replays > 0


def test_catch_up_after_plain_steps_runs_eagerly():
    """After steps that drafted nothing (CAST's plain steps, on by default), the draft forwards the
    tokens it owes in one forward of a one-off width: that forward runs eagerly, never capturing
    a graph mid-decode, while the usual forwards still replay; greedy output is the target's own."""
    from test_kv_commit import _Deferring

    from specdec.drafting import ChainPolicy

    target, draft = close_pair("llama")
    refs = [reference(target, p, 24) for p in PROMPTS]
    source = ModelDraftSource(draft, static_shapes=True)
    policy = _Deferring(ChainPolicy(k=3), lambda s: s % 5 != 4)  # four plain steps, then one drafted (owing 4-5 tokens)
    engine = SpeculativeEngine(target, policy, GreedyRule(), source, eos_token_ids=[EOS], static_shapes=True)
    engine.target.graphs, source.runner.graphs = emulators = [ReplayEmulator(), ReplayEmulator()]
    forwards = []
    forward = source.runner.forward
    source.runner.forward = lambda ids, *a, **k: forwards.append(ids.shape[1]) or forward(ids, *a, **k)
    outs = engine.generate(PROMPTS, 24, batch_size=3)
    assert [o.token_ids for o in outs] == refs
    assert max(forwards) >= 4, "the pattern must leave the draft owing several tokens"
    widths = sorted({key[1] for key in emulators[1].traces})  # the bucketed widths m that were captured
    assert widths and max(widths) <= 2, f"a catch-up forward was captured: widths {widths}"
    assert emulators[1].replays > 0


# ----- captured drafting levels (specdec.drafting.levels) ---------------------------------------
def level_engine(target, draft, method: str, rule: Any = None, **options: Any) -> tuple[SpeculativeEngine, ReplayEmulator]:
    """An emulated engine whose draft also captures whole drafting levels (emulated)."""
    source = ModelDraftSource(draft, static_shapes=True)
    engine = SpeculativeEngine(target, make_policy(method, **options), rule or GreedyRule(), source, eos_token_ids=[EOS], static_shapes=True)
    engine.target.graphs, source.runner.graphs = ReplayEmulator(), ReplayEmulator()
    source.runner.level_graphs = levels = ReplayEmulator()
    source.runner.capture_every_level = True  # SPECDEC_CAPTURE_LEVELS=1: greedy steps' levels too
    source.runner.time_forwards = False  # captured levels need untimed forwards (`CapturedLevels.for_step`)
    return engine, levels


LEVEL_METHODS = {
    "chain": {"k": 4},
    "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10},
    "static": {"depth": 3, "branching": 2, "max_nodes": 12},
    # inside a free width (CUDA's default rules): top-k children, levels of static widths, the growing
    # count read from D_0 on (phase 3's gate), calibrated values whose tables a refit writes over
    "dynatree": {"free_tokens": 24},
}
SAMPLED_LEVEL_METHODS = ("chain", "dynatree", "eagle2", "static")
"""policies whose sampled children are captured too"""


FIXED_PLACES = ("cast", "dynatree")
"""policies whose captured levels sit at fixed builder columns (`CapturedLevels.place`): their
builder numbering has holes where op by op has none"""


def checked_nodes(drafted: Any, by_tokens: bool) -> torch.Tensor:
    """What a draft's builder nodes are compared by: the nodes themselves, or (by_tokens, a policy
    of `FIXED_PLACES`, whose numbering differs from op by op's) the builder's tokens at them; the
    commit of the draft cache (the output, the forward counts) checks the rest."""
    if by_tokens and drafted.builder is not None:
        return drafted.builder.tokens.gather(1, drafted.builder_nodes)
    return drafted.builder_nodes


def recorded_drafts(engine: SpeculativeEngine) -> list[Any]:
    """Record every step's draft from now on: the tree's tokens, parents, validity and ancestors,
    and the builder nodes they came from (`builder_nodes`; host lists)."""
    drafts: list[Any] = []
    draft = engine.policy.draft
    by_tokens = engine.policy.name in FIXED_PLACES

    def recording(*args: Any) -> Any:
        drafted = draft(*args)
        tree = drafted.tree
        nodes = checked_nodes(drafted, by_tokens)
        drafts.append([t.tolist() for t in (tree.tokens, tree.parents, tree.valid, tree.ancestor_mask(), nodes)])
        return drafted

    engine.policy.draft = recording  # type: ignore[method-assign]
    return drafts


LEVEL_CASES = [
    *((arch, "close") for arch in ("llama", "gpt_neox", "gpt2", "qwen2")),
    *((arch, "identical") for arch in ("llama", "gpt2")),  # the pending leaf is the engine's, not the architecture's: two archs
]


@pytest.mark.parametrize(("arch", "pair"), LEVEL_CASES)
@pytest.mark.parametrize("method", sorted(LEVEL_METHODS))
def test_captured_levels_replay_exactly(arch, method, pair):
    """With every drafting level replayed from its trace, each step drafts the very tree the
    op-by-op engine drafts (rows finishing and prompts joining at batch size 3), the output is
    `generate`'s, and the host state replayed levels set (forward counters) matches. An
    identical draft has every chain accepted whole, so each step starts with the last one's
    leaf pending (read from the last step's tree, which the next builder overwrites)."""
    target, draft = close_pair(arch) if pair == "close" else (sharpen(tiny_model(arch, seed=0)), sharpen(tiny_model(arch, seed=0)))
    refs = [reference(target, p, 32) for p in PROMPTS]
    engine, levels = level_engine(target, draft, method, **LEVEL_METHODS[method])
    drafts = recorded_drafts(engine)
    outs = engine.generate(PROMPTS, 32, batch_size=3)
    assert [o.token_ids for o in outs] == refs
    # DynaTree's keys also name its level widths and growth thresholds, which its history moves: fewer replays per capture
    assert levels.captures > 0 and levels.replays > (1 if method == "dynatree" else 3) * levels.captures, "levels must replay their traces"
    eager_source = ModelDraftSource(draft, static_shapes=True)
    eager = SpeculativeEngine(target, make_policy(method, **LEVEL_METHODS[method]), GreedyRule(), eager_source, eos_token_ids=[EOS], static_shapes=True)
    eager_drafts = recorded_drafts(eager)
    eager.generate(PROMPTS, 32, batch_size=3)
    assert drafts == eager_drafts
    assert engine.source.runner.forward_calls == eager_source.runner.forward_calls
    assert engine.source.runner.forward_tokens == eager_source.runner.forward_tokens


class BoundedReplayEmulator(ReplayEmulator):
    """A `ReplayEmulator` that holds at most `max_graphs` traces, the least recently used dropped
    first, as `CudaGraphRunner` does with `max_graphs`."""

    def __init__(self, max_graphs: int) -> None:
        super().__init__()
        self.max_graphs = max_graphs
        self.traces = OrderedDict()

    def __len__(self) -> int:
        return len(self.traces)

    def __contains__(self, key: object) -> bool:
        return key in self.traces

    def least_recent(self) -> Any:
        return next(iter(self.traces), None)

    def run(self, key: tuple[Any, ...], call: Callable[[], torch.Tensor], keepalive: Any) -> torch.Tensor:
        if key in self.traces:
            self.traces.move_to_end(key)
        out = super().run(key, call, keepalive)
        while len(self.traces) > self.max_graphs:
            self.traces.popitem(last=False)
        return out


@pytest.mark.parametrize("stale_runs", [10**9, 0])
def test_a_full_set_of_level_graphs_keeps_replaying(monkeypatch, stale_runs):
    """More level keys recur than graphs fit (the chain's 4 levels at batch sizes 3, 2 and 1, in
    2 graphs): the graphs held keep replaying and the other keys run op by op, so captures stay at
    the bound and the output is `generate`'s. With every graph stale at once (STALE_RUNS 0) the keys
    evict each other in turn and most runs are captures: what the bound on eviction prevents."""
    monkeypatch.setattr(static, "STALE_RUNS", stale_runs)
    target, draft = close_pair("llama")
    refs = [reference(target, p, 12) for p in PROMPTS]
    engine, _ = level_engine(target, draft, "chain", k=4)
    engine.source.runner.level_graphs = levels = BoundedReplayEmulator(max_graphs=2)
    outs = engine.generate(PROMPTS, 12, batch_size=3)
    assert [o.token_ids for o in outs] == refs
    keys = len(engine.source.runner.level_uses.last)
    assert keys > 2 * levels.max_graphs, keys  # the keys outnumber the graphs
    if stale_runs:
        assert levels.captures == levels.max_graphs and levels.replays >= 4 * levels.captures, (levels.captures, levels.replays)
    else:
        assert levels.captures > 3 * levels.max_graphs, (levels.captures, levels.replays)


def test_a_level_that_bakes_the_cache_length_fails(monkeypatch):
    """The check can fail: a level whose forward takes S_past from the host (`fill`, not
    `fill_at`) has the first capture's length baked into its trace, and replays at later steps
    attend to the wrong slots. The output stays the target's (the draft only proposes); the
    drafts, seen in the steps each prompt takes, are no longer the op-by-op ones."""

    def host_offsets(self, input_ids, position_ids, step_visibility, m):
        cache, shared = self._cache(), self._shared
        buf = shared.inputs(input_ids.shape[0], m, cache.capacity, self.dtype, self.device)
        buf.fill(input_ids, position_ids, self.past_len + self.step_len, self.slot_valid, step_visibility)
        cache.length, cache.static = self.past_len + self.step_len, buf
        try:
            return self._call_static_backends(buf)[:, : input_ids.shape[1]].float()
        finally:
            cache.static = None

    monkeypatch.setattr(ModelRunner, "_forward_in_level", host_offsets)
    target, draft = close_pair("llama")
    refs = [reference(target, p, 32) for p in PROMPTS]
    engine, levels = level_engine(target, draft, "chain", k=4)
    drafts = recorded_drafts(engine)
    outs = engine.generate(PROMPTS, 32, batch_size=3)
    assert levels.replays > 0
    assert [o.token_ids for o in outs] == refs
    eager = SpeculativeEngine(target, make_policy("chain", k=4), GreedyRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True)
    eager_drafts = recorded_drafts(eager)
    eager.generate(PROMPTS, 32, batch_size=3)
    assert drafts != eager_drafts


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_captured_top_k_levels_under_sampling_equal_op_by_op(temperature):
    """EAGLE-2 with top-k children (`tree_sampling=topk`) keeps no draft distributions, so its
    levels are captured at T > 0 too: the same draws as op by op, one seed."""
    target, draft = close_pair("llama")
    params = SamplingParams(temperature=temperature, top_p=0.9)
    options = {**LEVEL_METHODS["eagle2"], "tree_sampling": "topk"}
    engine, levels = level_engine(target, draft, "eagle2", rule=SamplingRule(), **options)
    replayed = [o.token_ids for o in engine.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)]
    eager = SpeculativeEngine(target, make_policy("eagle2", **options), SamplingRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True)
    assert replayed == [o.token_ids for o in eager.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)]
    assert levels.replays > 0


def recorded_sampled_drafts(engine: SpeculativeEngine) -> list[Any]:
    """`recorded_drafts`, with each tree's sampled flags and kept draft distributions."""
    drafts: list[Any] = []
    draft = engine.policy.draft
    by_tokens = engine.policy.name in FIXED_PLACES

    def recording(*args: Any) -> Any:
        drafted = draft(*args)
        tree = drafted.tree
        nodes = checked_nodes(drafted, by_tokens)
        fields = [t.tolist() for t in (tree.tokens, tree.parents, tree.valid, tree.sampled, nodes)]
        drafts.append((fields, None if tree.draft_logprobs is None else tree.draft_logprobs.clone()))
        return drafted

    engine.policy.draft = recording  # type: ignore[method-assign]
    return drafts


def same_drafts(a: list[Any], b: list[Any], atol: float = 0.0) -> bool:
    """Equal trees step for step, with kept draft distributions equal bit for bit (atol 0) or
    within `atol`."""

    def close(da: torch.Tensor | None, db: torch.Tensor | None) -> bool:
        if da is None or db is None:
            return da is None and db is None
        return torch.equal(da, db) if atol == 0 else da.shape == db.shape and bool(torch.allclose(da, db, atol=atol, rtol=0))

    return len(a) == len(b) and all(fa == fb and close(da, db) for (fa, da), (fb, db) in zip(a, b, strict=True))


@pytest.mark.parametrize("method", SAMPLED_LEVEL_METHODS)
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_captured_sampled_levels_draw_what_op_by_op_draws(method, top_p):
    """Children drawn from the draft (the chain's tokens, the static tree's and EAGLE-2's sampled
    children) are captured too: each level's random numbers are drawn before its replay, from the
    step's generator, as op-by-op drafting draws them. So one seed gives the same trees, the same
    kept draft distributions and the same output, at T = 0.8 with rows finishing and joining at
    batch size 3. The distributions agree bit for bit, but DynaTree's to float rounding: its
    captured levels sit at fixed step slots (`CapturedLevels.place`), so the draft's keys lie at
    other cache columns than op by op and attention sums them in another order."""
    target, draft = close_pair("llama")
    params = SamplingParams(temperature=0.8, top_p=top_p)
    engine, levels = level_engine(target, draft, method, rule=SamplingRule(), **LEVEL_METHODS[method])
    drafts = recorded_sampled_drafts(engine)
    replayed = [o.token_ids for o in engine.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)]
    assert levels.captures > 0 and levels.replays > 2 * levels.captures, "sampled levels must replay their traces"
    eager = SpeculativeEngine(target, make_policy(method, **LEVEL_METHODS[method]), SamplingRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True)
    eager_drafts = recorded_sampled_drafts(eager)
    assert replayed == [o.token_ids for o in eager.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)]
    assert any(sampled for (fields, _) in drafts for row in fields[3] for sampled in row), "the steps must draw their children"
    assert same_drafts(drafts, eager_drafts, atol=1e-5 if method == "dynatree" else 0.0)


def near_pair(arch: str, noise: float = 0.005) -> tuple[Any, Any]:
    """A sharpened tiny target and its copy with a little noise: agrees often enough that CAST's
    break-even rules draft several layers of changing widths."""
    target, draft = sharpen(tiny_model(arch, seed=0)), sharpen(tiny_model(arch, seed=0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return target, draft


def real_columns(tree: Any) -> int:
    """The tree's columns up to its last valid node in any row (a captured CAST selection pads the
    tree to the node bucket of its width with invalid columns)."""
    return int(tree.valid.any(dim=0).nonzero().max()) + 1


def recorded_real_drafts(engine: SpeculativeEngine, widths: list[tuple[int, ...]]) -> list[Any]:
    """Each step's tree (tokens of valid nodes, parents, validity, up to its last valid column; not
    the builder nodes, whose layout captured CAST layers pad) and the policy's layer widths
    (appended to `widths`)."""
    drafts: list[Any] = []
    draft = engine.policy.draft

    def recording(*args: Any) -> Any:
        drafted = draft(*args)
        tree = drafted.tree
        n = real_columns(tree)
        drafts.append([t[:, :n].tolist() for t in (tree.tokens.masked_fill(~tree.valid, -1), tree.parents, tree.valid)])
        widths.append(tuple(engine.policy.last_widths))
        return drafted

    engine.policy.draft = recording  # type: ignore[method-assign]
    return drafts


@pytest.mark.parametrize("reads_while_drafting", [False, True], ids=["unread", "read"])
def test_captured_cast_layers_draft_what_op_by_op_drafts(reads_while_drafting):
    """CAST's break-even layers replay as captured graphs at a node bucket of their planned width,
    the columns beyond it masked out on the device: every step's tree is the op-by-op one (valid
    nodes, parents, validity), rows finishing and joining at batch size 3, and the output is
    `generate`'s. Deterministic (no wall-clock overheads) so both engines plan alike; the pair
    agrees often enough for several layers, some narrower than their bucket (masking matters:
    unmasked padding columns would grow valid children and change the trees). CAST's default
    calibrated values: with raw draft confidences this pair rarely drafts past the first layer.
    Both ways of deciding a step: from the plan alone, its values read after the verification's
    launch (the CUDA default), and from values read while drafting."""
    target, draft = near_pair("llama")  # the architectures' forwards inside levels: `test_captured_levels_replay_exactly`
    options = {**cast_level_options(), "reads_while_drafting": reads_while_drafting}
    refs = [reference(target, p, 32) for p in PROMPTS]
    engine, levels = level_engine(target, draft, "cast", **options)
    widths: list[tuple[int, ...]] = []
    drafts = recorded_real_drafts(engine, widths)
    outs = engine.generate(PROMPTS, 32, batch_size=3)
    assert [o.token_ids for o in outs] == refs
    assert levels.captures > 0 and levels.replays > levels.captures, "layers must replay their traces"
    assert any(w[i] not in (1, 2, 4) for w in widths for i in range(len(w) - 1)), f"no layer narrower than its bucket: {widths}"
    eager = SpeculativeEngine(target, make_policy("cast", **options), GreedyRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True)
    eager_widths: list[tuple[int, ...]] = []
    eager_drafts = recorded_real_drafts(eager, eager_widths)
    eager.generate(PROMPTS, 32, batch_size=3)
    assert widths == eager_widths
    assert drafts == eager_drafts


@pytest.mark.parametrize("method", ["cast", "dynatree"])
def test_a_captured_level_has_one_key_whatever_the_widths_before_it(method, monkeypatch):
    """CAST's planned layer widths and DynaTree's growing counts change from step to step. Each
    captured level sits at a builder column and a step slot fixed by its level alone
    (`CapturedLevels.place`), so the builder and runner state in a level's graph key (what a replay
    sets) is one per level name, whatever was drafted before it; a selection's, one per tree depth.
    Laid out contiguously, a layer's state followed the sum of the widths before it, and each
    sequence of widths was a key of its own: 457 captures in 10 calls of CAST on an H100. The run
    must draft one level after different widths, or the check could not fail."""
    from specdec.drafting import levels as levels_module

    states: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}
    key = levels_module.CapturedLevels.key
    fields = len(levels_module._BUILDER_STATE) + 1  # the builder's fields and the runner's step slots

    def recording(self: Any, name: tuple[Any, ...], reads: Any) -> tuple[Any, ...]:
        out = key(self, name, reads)
        state = out[2 : 2 + fields]
        group = (name, state[2]) if name[0] == "selection" else name  # a selection: per tree depth (the builder's level count)
        states.setdefault(group, set()).add(state)
        return out

    monkeypatch.setattr(levels_module.CapturedLevels, "key", recording)
    # a replay adds the nodes its level added (a counter, not a field of the key): whatever the nodes before it
    added: list[tuple[int, int]] = []
    run_level = levels_module.CapturedLevels.run

    def counting(self: Any, name: tuple[Any, ...], *args: Any, **kwargs: Any) -> None:
        builder = self.builder
        n, count = builder.num_nodes, builder.nodes_added
        run_level(self, name, *args, **kwargs)
        added.append((builder.nodes_added - count, builder.num_nodes - n))

    monkeypatch.setattr(levels_module.CapturedLevels, "run", counting)
    if method == "cast":
        target, draft = near_pair("llama")
        options: dict[str, Any] = {**cast_level_options(), "reads_while_drafting": False}
    else:  # phase 2: D_0 held at 2, from where the deep gate reads the growing count of each level
        target, draft = near_pair("llama")
        options = {"free_tokens": 24, "phase": 2, "d0": 2, "d_max": 6, "rho_stop": 0.001, "rho_deep": 0.01}
        # this pair's growing counts barely change between steps: every other read keeps one growing node
        from specdec.drafting.dynatree import DynaTreePolicy

        cut, reads = DynaTreePolicy._growing_frontier, [0]

        def alternating(frontier: torch.Tensor, frontier_valid: torch.Tensor) -> Any:
            reads[0] += 1
            out = cut(frontier, frontier_valid)
            return out if out is None or reads[0] % 2 else (out[0][:, :1], out[1][:, :1])

        monkeypatch.setattr(DynaTreePolicy, "_growing_frontier", staticmethod(alternating))
    engine, levels = level_engine(target, draft, method, **options)
    widths: list[tuple[int, ...]] = []
    recorded_real_drafts(engine, widths) if method == "cast" else None
    frontiers: dict[int, set[tuple[int, ...]]] = {}
    if method == "dynatree":  # the frontier widths before each level (DynaTree's `level` names carry the level's own)
        seen: list[int] = []

        def tracking(self: Any, name: tuple[Any, ...], *args: Any, **kwargs: Any) -> None:
            if name[0] == "level":
                if name[1] == 0:
                    seen.clear()
                frontiers.setdefault(name[1], set()).add(tuple(seen))
                seen.append(name[2])
            return counting(self, name, *args, **kwargs)

        monkeypatch.setattr(levels_module.CapturedLevels, "run", tracking)
    engine.generate(PROMPTS, 32, batch_size=3)
    assert levels.replays > 0
    if method == "cast":
        prefixes: dict[int, set[tuple[int, ...]]] = {}
        for w in widths:
            for level in range(2, len(w)):
                prefixes.setdefault(level, set()).add(w[: level - 1])
        assert any(len(p) > 1 for p in prefixes.values()), f"no layer drafted after different widths: {widths}"
    else:
        assert any(len(p) > 1 for p in frontiers.values()), f"no level drafted after different frontier widths: {frontiers}"
    varied = {group: sorted(s) for group, s in states.items() if len(s) > 1}
    assert not varied, f"levels whose key followed the widths before them: {varied}"
    assert added and all(a == n for a, n in added), "a level adds the nodes it writes, replayed or not"
    assert any(a > 0 for a, _ in added)


def test_captured_cast_sampled_layers_draw_what_op_by_op_draws():
    """CAST's layers of drawn children (T = 0.5, one seed) are captured too: each layer's first
    `width` columns of random numbers are drawn before its replay as op by op draws them (the
    bucket's other columns are masked out), so every step draws the op-by-op tree (valid tokens,
    parents, validity, sampled flags) with the same layer widths, and the output is the op-by-op
    output. The kept draft distributions of the tree's nodes agree to float rounding: the padding
    columns take step slots, so later layers' keys sit at other cache columns and attention sums
    them in another order. Steps decided from the plan alone (the CUDA default)."""
    target, draft = near_pair("llama")
    options = {**cast_level_options(), "reads_while_drafting": False}
    params = SamplingParams(temperature=0.5)

    def run(engine: SpeculativeEngine) -> tuple[list[list[int]], list[Any], list[tuple[int, ...]]]:
        drafts: list[Any] = []
        widths: list[tuple[int, ...]] = []
        draft_step = engine.policy.draft

        def recording(*args: Any) -> Any:
            drafted = draft_step(*args)
            tree = drafted.tree
            v, n = tree.valid, real_columns(tree)
            fields = [t[:, :n].tolist() for t in (tree.tokens.masked_fill(~v, -1), tree.parents, v, tree.sampled & v)]
            drafts.append((fields, tree.draft_logprobs[v].clone()))
            widths.append(tuple(engine.policy.last_widths))
            return drafted

        engine.policy.draft = recording  # type: ignore[method-assign]
        outs = engine.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)
        return [o.token_ids for o in outs], drafts, widths

    engine, levels = level_engine(target, draft, "cast", rule=SamplingRule(), **options)
    outs, drafts, widths = run(engine)
    assert levels.captures > 0 and levels.replays > 0
    assert any(w[i] not in (1, 2, 4) for w in widths for i in range(len(w) - 1)), f"no layer narrower than its bucket: {widths}"
    eager = SpeculativeEngine(target, make_policy("cast", **options), SamplingRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True)
    eager_outs, eager_drafts, eager_widths = run(eager)
    assert outs == eager_outs and widths == eager_widths
    assert any(any(row) for fields, _ in drafts for row in fields[3]), "the steps must draw their children"
    assert [fields for fields, _ in drafts] == [fields for fields, _ in eager_drafts]
    for (_, dists), (_, eager_dists) in zip(drafts, eager_drafts, strict=True):
        torch.testing.assert_close(dists, eager_dists, atol=1e-5, rtol=0)


def test_levels_of_other_sampling_params_are_captured_apart(monkeypatch):
    """The sampling params shape every level (the draft's distributions), so they are part of its
    key: one draft model's levels drafted at T = 0.8, then at T = 0.5, then greedily, each draw
    what op-by-op drafting draws. The check can fail: without the params in the key, the T = 0.5
    calls replay the T = 0.8 levels."""
    from specdec.drafting import levels as levels_module

    target, draft = close_pair("llama")
    shared = ReplayEmulator()

    def run(params: SamplingParams, capture: bool) -> list[Any]:
        source = ModelDraftSource(draft, static_shapes=True)
        engine = SpeculativeEngine(target, make_policy("chain", k=4), SamplingRule(), source, eos_token_ids=[EOS], static_shapes=True)
        source.runner.level_graphs, source.runner.time_forwards = (shared if capture else None), False
        drafts = recorded_sampled_drafts(engine)
        engine.generate(PROMPTS[:2], 16, params=params, seed=5, batch_size=2)
        return drafts

    settings = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.5), SamplingParams()]
    alone = [run(params, capture=False) for params in settings]
    assert all(same_drafts(run(params, capture=True), drafts) for params, drafts in zip(settings, alone, strict=True))
    assert shared.replays > 0
    begin = levels_module.CapturedLevels.begin

    def without_params(self: Any, builder: Any, step_slots: int) -> None:
        begin(self, builder, step_slots)
        self._base = self._base[1:]

    monkeypatch.setattr(levels_module.CapturedLevels, "begin", without_params)
    shared.clear()
    for _ in range(2):
        run(settings[0], capture=True)
    assert not same_drafts(run(settings[1], capture=True), alone[1])


def test_level_keys_name_every_host_field_a_replay_sets():
    """A replay sets the builder's host fields to what the capture left, so the key names each of
    them as it was before the level: a change in any one gives another graph. Without the count of
    levels in the key, two CAST layouts with the same node count and a different number of layers
    shared a selection graph, whose replay restored the other step's depth bound, and the accepted
    path overran it."""
    from types import SimpleNamespace

    from specdec.drafting.levels import _BUILDER_STATE, CapturedLevels

    _, draft = close_pair("llama")
    source = ModelDraftSource(draft, static_shapes=True)
    source.runner.level_graphs = ReplayEmulator()
    source.runner.time_forwards = False
    levels = CapturedLevels.for_step(source, ("cast",), sampled=True)
    assert levels is not None
    state = {"_n": 17, "_last": (5, 17), "levels": 2, "max_children": 4, "draft_forwards": 2, "_dist_rows": 3, "_any_sampled": False}
    assert set(state) == set(_BUILDER_STATE)
    levels.builder = SimpleNamespace(**state)  # type: ignore[assignment]
    base = levels.key(("selection", 8), ())
    for name, value in state.items():
        levels.builder = SimpleNamespace(**{**state, name: (value, 1) if isinstance(value, tuple) else not value if isinstance(value, bool) else value + 1})  # type: ignore[assignment]
        assert levels.key(("selection", 8), ()) != base, name


def test_levels_are_not_captured_where_they_cannot_be():
    """Timed forwards and runners without level graphs run their levels op by op."""
    from specdec.drafting.levels import CapturedLevels

    _, draft = close_pair("llama")
    source = ModelDraftSource(draft, static_shapes=True)
    assert CapturedLevels.for_step(source, ("chain",), sampled=True) is None  # no level graphs
    source.runner.level_graphs = ReplayEmulator()
    source.runner.time_forwards = False
    assert CapturedLevels.for_step(source, ("chain",), sampled=True) is not None
    assert CapturedLevels.for_step(None, ("chain",), sampled=True) is None
    source.runner.time_forwards = True
    assert CapturedLevels.for_step(source, ("chain",), sampled=True) is None


def test_levels_serve_one_drafting_thread():
    """A model's level buffers are the model's: the first thread to draft with captured levels owns
    them while it lives, a step drafted in another thread meanwhile runs op by op (its forwards
    still graphed), and once the owner has ended the next thread to draft takes them over (a
    server's decode thread after the main thread's own calls, or a restarted one)."""
    import threading

    from specdec.drafting.levels import CapturedLevels

    draft = sharpen(tiny_model("llama", seed=4))  # a model of its own: no other test's thread has claimed its levels
    source = ModelDraftSource(draft, static_shapes=True)
    source.runner.level_graphs, source.runner.time_forwards = ReplayEmulator(), False
    found: dict[str, bool] = {}

    def here(name: str) -> None:
        found[name] = CapturedLevels.for_step(source, ("chain",), sampled=True) is not None

    def worker(name: str, drafted: threading.Event, release: threading.Event) -> None:
        twin = ModelDraftSource(draft, static_shapes=True)
        twin.runner.level_graphs, twin.runner.time_forwards = source.runner.level_graphs, False
        found[name] = CapturedLevels.for_step(twin, ("chain",), sampled=True) is not None
        drafted.set()
        release.wait()

    def start(name: str) -> tuple[threading.Thread, threading.Event]:
        drafted, release = threading.Event(), threading.Event()
        thread = threading.Thread(target=worker, args=(name, drafted, release))
        thread.start()
        drafted.wait()
        return thread, release

    here("main")
    thread, release = start("worker while main lives")
    release.set()
    thread.join()
    here("main again")
    assert found == {"main": True, "worker while main lives": False, "main again": True}

    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    source.runner._shared.level_thread = ended  # the owner has ended: the next thread to draft takes over
    thread, release = start("takes over")
    here("main while it lives")
    release.set()
    thread.join()
    here("main after it ended")
    assert (found["takes over"], found["main while it lives"], found["main after it ended"]) == (True, False, True)


def test_levels_captured_by_default_are_the_sampled_steps_of_all_but_cast(monkeypatch):
    """SPECDEC_CAPTURE_LEVELS unset: a sampled step's levels are captured, a greedy step's run op by
    op, and CAST's (its planned widths change its keys) only when asked for; =1 captures every
    step's, =0 none (measured on an H100, `capture_levels_default`)."""
    from specdec.drafting.levels import CapturedLevels
    from specdec.models.runner import CAPTURE_LEVELS_ENV

    _, draft = close_pair("llama")
    for setting, greedy, sampled, cast in ((None, False, True, False), ("1", True, True, True), ("0", False, False, False)):
        if setting is None:
            monkeypatch.delenv(CAPTURE_LEVELS_ENV, raising=False)
        else:
            monkeypatch.setenv(CAPTURE_LEVELS_ENV, setting)
        source = ModelDraftSource(draft, static_shapes=True)  # a runner reads the setting when it is made
        if setting != "0":
            source.runner.level_graphs = ReplayEmulator()  # what a CUDA runner makes (a CPU runner has no graphs)
        source.runner.time_forwards = False
        found = (
            CapturedLevels.for_step(source, ("eagle2",), sampled=False) is not None,
            CapturedLevels.for_step(source, ("eagle2",), sampled=True) is not None,
            CapturedLevels.for_step(source, ("cast",), sampled=True, by_default=False) is not None,
        )
        assert found == (greedy, sampled, cast), setting


def test_captured_levels_replay_across_engines(tiny_pair_dir, monkeypatch):
    """`SpeculativeDecoder.generate` makes a new engine (and draft source) per call, as a bench's
    timed calls and a server's lanes do. The levels a first call captured replay in the next: the
    level state (graphs, builder workspace, slot bookkeeping) is the draft model's, not a runner's.
    The second call captures nothing new and drafts what op-by-op drafting does."""
    from specdec.api import SpeculativeDecoder
    from specdec.models.static import shared_state

    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="eagle2", device="cpu", static_shapes=True)
    levels = shared_state(decoder.draft).level_graphs = ReplayEmulator()
    make_engine = SpeculativeEngine.__init__

    def with_levels(self: SpeculativeEngine, *args: Any, **kwargs: Any) -> None:
        make_engine(self, *args, **kwargs)
        self.source.runner.level_graphs = shared_state(self.source.runner.model).level_graphs  # the model's, as CUDA runners take it
        self.source.runner.capture_every_level = True
        self.source.runner.time_forwards = False

    monkeypatch.setattr(SpeculativeEngine, "__init__", with_levels)
    drafts = recorded_drafts(decoder.engine("greedy"))  # the decoder's policy, shared by the engines of its calls
    prompts = ["def add(a, b):", "for i in range(3):"]
    first = decoder.generate(prompts, max_new_tokens=24, batch_size=2)
    captured, first_drafts = set(levels.traces), len(drafts)
    second = decoder.generate(prompts, max_new_tokens=24, batch_size=2)
    # keys are (policy, (what, ...), ...): a level's first use in the second call replays the first call's
    # capture; a selection after fewer levels (the last steps' shorter trees) may be new, met once before
    new_levels = [key for key in set(levels.traces) - captured if key[1][0] == "level"]
    assert any(key[1][0] == "level" for key in captured) and not new_levels, "the second call's engine must replay the first's levels"
    assert levels.replays > 0 and [r.text for r in first] == [r.text for r in second]
    shared_state(decoder.draft).level_graphs = None
    replayed = drafts[first_drafts:]
    del drafts[:]
    third = decoder.generate(prompts, max_new_tokens=24, batch_size=2)  # op by op
    assert replayed == drafts and [r.text for r in third] == [r.text for r in first]


def test_interleaved_sessions_of_one_draft_model_draft_as_alone():
    """Two engines over the same draft model (a server's lanes) stepped in turn share the model's
    level state: each step the slot bookkeeping changes hands and is laid out afresh, so both
    draft step for step what each drafts alone, op by op. The chain skips every other step, so
    each drafted step forwards two owed tokens: a layout of P = 2 pending slots it keeps from one
    of its steps to the next, while EAGLE-2 (P = 1) writes node slots over it in between."""
    from test_kv_commit import _Deferring

    target, draft = close_pair("llama")
    shared = ReplayEmulator()

    def make(method: str, capture: bool) -> SpeculativeEngine:
        source = ModelDraftSource(draft, static_shapes=True)
        policy = make_policy(method, **LEVEL_METHODS[method])
        if method == "chain":
            policy = _Deferring(policy, lambda step: step % 2 == 1)
        engine = SpeculativeEngine(target, policy, GreedyRule(), source, eos_token_ids=[EOS], static_shapes=True)
        source.runner.level_graphs, source.runner.time_forwards, source.runner.capture_every_level = (shared if capture else None), False, True
        return engine

    alone = {}
    for method in ("chain", "eagle2"):
        engine = make(method, capture=False)
        drafts = recorded_drafts(engine)
        engine.generate(PROMPTS[:2], 24, batch_size=2)
        alone[method] = drafts
    engines = {method: make(method, capture=True) for method in ("chain", "eagle2")}
    drafts = {method: recorded_drafts(engine) for method, engine in engines.items()}
    sessions = {method: engine.session(max_rows=2) for method, engine in engines.items()}
    for session in sessions.values():
        for prompt in PROMPTS[:2]:
            session.submit(prompt, 24)
    while not all(s.idle for s in sessions.values()):
        for session in sessions.values():
            if not session.idle:
                session.step()
    assert drafts == alone
    assert shared.replays > 0


# ----- captured verification walks (specdec.verification.captured) -----------------------------
WALK_METHODS = {
    "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10},
    "static": {"depth": 3, "branching": 2, "max_nodes": 12},
    "dynatree": {"free_tokens": 24},
    "cast": cast_level_options(),  # deterministic: its plans do not follow wall-clock times, so both runs plan alike
}


def walk_engine(target: Any, draft: Any, method: str, capture: bool, rule: Any = None) -> tuple[SpeculativeEngine, ReplayEmulator | None]:
    """An emulated engine testing sampled trees on the device (traversal, `walk="device"`, CUDA's
    default; or `rule`'s device tests), its walks captured (emulated) when `capture`, else op by op."""
    source = ModelDraftSource(draft, static_shapes=True)
    rule = SamplingRule(walk="device") if rule is None else rule
    engine = SpeculativeEngine(target, make_policy(method, **WALK_METHODS[method]), rule, source, eos_token_ids=[EOS], static_shapes=True)
    engine.target.graphs, source.runner.graphs = ReplayEmulator(), ReplayEmulator()
    walks = engine.target.walk_graphs = ReplayEmulator() if capture else None
    return engine, walks


@pytest.mark.parametrize("method", sorted(WALK_METHODS))
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_captured_walks_verify_what_op_by_op_verifies(method, temperature, top_p):
    """The traversal walk of sampled trees on the device, planned before the verify forward and
    walked after it as (emulated) graph replays, with its random numbers drawn before it from the
    step's generator: one seed gives the op-by-op output and steps, with rows finishing and
    joining at batch size 3, and the plan and the walk replay their traces (each trace runs once
    when it is made: a capture's run goes through the trace too)."""
    captured, op_by_op = captured_and_op_by_op_walks(method, lambda: SamplingRule(walk="device"), SamplingParams(temperature=temperature, top_p=top_p), seed=3)
    assert captured == op_by_op


def captured_and_op_by_op_walks(method: str, rule: Callable[[], Any], params: SamplingParams, seed: int) -> list[list[tuple[list[int], int, int]]]:
    """One call of 8 prompts × 48 tokens at batch size 3 with the target's walks captured
    (emulated), then op by op: [(tokens, steps, relaxed tokens) per prompt] each. Checks that the
    walks were captured and replayed. (48 tokens: CAST's deep trees take 24 steps, enough for
    its keys to recur.)"""
    target, draft = close_pair("llama")
    runs = []
    for capture in (True, False):
        engine, walks = walk_engine(target, draft, method, capture, rule=rule())
        outs = engine.generate(PROMPTS * 2, 48, params=params, seed=seed, batch_size=3)
        runs.append([(o.token_ids, o.stats.steps, o.stats.relaxed_tokens) for o in outs])
        if walks is not None:
            assert walks.captures >= 1 and walks.replays > walks.captures, (walks.captures, walks.replays)
    return runs


@pytest.mark.parametrize("method", ["eagle2", "dynatree", "static"])
@pytest.mark.parametrize("theta", [0.9, 1.0])
def test_captured_mars_tests_verify_what_op_by_op_verifies(method, theta):
    """MARS at T = 1 on the device: its margins, outright choices and child-by-child tests replayed
    as one (emulated) graph (theta 1: the lossless rule's captured traversal) give the op-by-op
    output, steps and relaxed counts for a seed."""
    from specdec.verification.mars import MarsRule

    captured, op_by_op = captured_and_op_by_op_walks(method, lambda: MarsRule(theta=theta, walk="device"), SamplingParams(temperature=1.0), seed=5)
    assert captured == op_by_op
    if theta < 1:
        assert sum(relaxed for _, _, relaxed in captured) > 0, "the relaxation must fire"


def test_a_walk_reading_outside_its_buffers_fails(monkeypatch):
    """The check above can fail: target logits copied into a new tensor each step (outside the
    walk's buffers) leave the replayed walk verifying the first capture's logits."""
    from specdec.verification import captured

    buffer = captured.CapturedWalks.buffer

    def unsafe_buffer(self, name, like):
        out = buffer(self, name, like)
        return out.clone() if name == "logits" else out

    monkeypatch.setattr(captured.CapturedWalks, "buffer", unsafe_buffer)
    target, draft = close_pair("llama")
    params = SamplingParams(temperature=1.0)
    runs = []
    for capture in (True, False):
        engine, _ = walk_engine(target, draft, "eagle2", capture)
        runs.append([o.token_ids for o in engine.generate(PROMPTS, 24, params=params, seed=3, batch_size=3)])
    assert runs[0] != runs[1]


def test_walk_buffers_share_one_tensor_and_growing_drops_the_walk_graphs():
    """A captured walk's buffers of every shape are the front of one flat tensor per name (no copy
    per batch size held), and a larger shape replaces that tensor and drops every walk graph,
    which read the old one."""
    from specdec.verification.captured import CapturedWalks

    runner = ModelRunner(tiny_model("llama", seed=0), static_shapes=True)
    runner.walk_graphs = graphs = ReplayEmulator()
    walks = CapturedWalks.for_step(runner)
    assert walks is not None
    first = walks.empty("logits", (2, 3, 5), torch.float32)
    graphs.run(("walk",), lambda: first.sum(dim=2), keepalive=())
    smaller = walks.buffer("logits", torch.ones(1, 4, 5))
    assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (1, 4, 5) and graphs.traces
    larger = walks.empty("logits", (4, 4, 5), torch.float32)
    assert larger.data_ptr() != first.data_ptr() and not graphs.traces
    runner.walk_graphs = None
    assert CapturedWalks.for_step(runner) is None
