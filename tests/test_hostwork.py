"""Host work outside model forwards: the counter itself, the engine's per-step budget of
host reads, and the half-precision divergence classifier of the benchmark."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import sharpen, tiny_model

from specdec.bench.divergence import TIE_ULPS, classify, first_difference, ulp
from specdec.drafting import ChainPolicy, Eagle2Policy, StaticTreePolicy, calibration
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.hostwork import HostCopy, HostWorkCounter, read_together, uncounted
from specdec.methods import make_policy
from specdec.models.runner import FORWARD_TIMING_ENV, ModelRunner, forward_timing_default
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule, SamplingRule


def test_counter_counts_ops_and_reads_outside_uncounted_regions():
    x = torch.arange(6.0)
    with HostWorkCounter(keep_names=True) as counter:
        y = x * 2 + 1  # two ops
        _ = y.view(2, 3)  # a view: not a working op
        _ = float(y.sum())  # one op, one read
        with uncounted():
            _ = (x @ x).item()  # neither counted
        _ = y.tolist()  # one read
    assert counter.ops == 3
    assert counter.ops_all == 5  # plus the view and the scalar read's own aten op
    assert counter.host_reads == 2
    assert counter.read_names == {"__float__": 1, "tolist": 1}
    assert counter.host_bytes == 4 + 6 * 4  # a float32 scalar, then six floats


def test_metadata_only_ops_are_not_counted():
    """`detach_` (issued by inference-mode steps) changes a tensor's autograd metadata and
    launches no kernel: not a working op, as a view is not."""
    with torch.inference_mode():
        x = torch.arange(6.0)
        with HostWorkCounter(keep_names=True) as counter:
            x.detach_()  # (outside inference mode it never reaches the dispatcher)
            _ = x + 1
    assert counter.ops == 1 and counter.op_names == {"add": 1}


def test_counter_is_inactive_outside_its_block():
    with HostWorkCounter() as counter:
        pass
    _ = torch.ones(3).sum().item()
    assert (counter.ops, counter.host_reads) == (0, 0)


def test_model_forwards_are_not_counted():
    runner = ModelRunner(tiny_model("llama", seed=0))
    ids = torch.tensor([[5, 6, 7]])
    with HostWorkCounter() as counter:
        runner.prefill(ids, torch.ones_like(ids))
    # prefill's own bookkeeping only: the dozens of ops inside the two-layer model are excluded
    assert counter.ops < 30
    assert counter.host_reads == 0


@pytest.mark.parametrize(
    "policy",
    [make_policy("ar"), ChainPolicy(k=4), StaticTreePolicy(depth=3, branching=2, max_nodes=10), Eagle2Policy(depth=4, top_k=3, total_tokens=10)],
    ids=lambda p: p.name,
)
def test_one_host_read_per_decoding_step(policy):
    """The hot path reads the device once per step (the verdict); admission is not a step."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=1, layers=1))
    source = ModelDraftSource(draft) if policy.uses_draft else None
    engine = SpeculativeEngine(target, policy, GreedyRule(), source, eos_token_ids=[])
    engine.generate([[5, 6, 7, 8]], 4)  # warm-up
    with HostWorkCounter(keep_names=True) as counter:
        out = engine.generate([[5, 6, 7, 8], [9, 10, 11]], 24)
    steps = max(o.stats.steps for o in out)
    reads = counter.read_names
    assert reads["tolist"] <= steps, reads  # the verdict, once per step
    # plus each cache's (target and draft) compaction check, once per 64 committed slots (a step commits at most 1 + depth per row)
    assert reads["item"] <= 2 * (steps * (1 + 4) // 64 + 1), reads
    assert sum(reads.values()) == counter.host_reads


def test_read_together_is_one_read_of_every_dtype_and_shape():
    torch.manual_seed(0)
    tensors = [
        torch.randint(-5, 9, (3, 5)),  # int64
        torch.rand(2, 3) > 0.5,  # bool: 6 bytes, padded
        torch.randn(7),  # float32: 28 bytes, padded
        torch.randn(2, 2, dtype=torch.float64),
        torch.randn(3, dtype=torch.bfloat16),  # widened to float32
        torch.randn(5, dtype=torch.float16),
        torch.zeros(0, 4),  # empty
        torch.tensor(3),  # 0-dim
    ]
    with HostWorkCounter(keep_names=True) as counter:
        host = read_together(*tensors)
    assert counter.host_reads == 1 and counter.read_names == {"cpu": 1}
    for t, h in zip(tensors, host, strict=True):
        want = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        assert h.dtype == want.dtype and h.shape == want.shape and (h == want).all(), (t.dtype, h, want)
    assert read_together() == []
    with pytest.raises(ValueError, match="one device"):
        read_together(torch.ones(2), torch.ones(2, device="meta"))


def _sampled_reads(policy) -> tuple[int, Counter[str], int]:
    """Two prompts decoded at T = 1 with `policy` on tiny models: (steps, host reads by name, all host reads)."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=1, layers=1))
    engine = SpeculativeEngine(target, policy, SamplingRule(), ModelDraftSource(draft), eos_token_ids=[])
    params = SamplingParams(temperature=1.0)
    engine.generate([[5, 6, 7, 8]], 4, params=params, seed=0)  # warm-up
    with HostWorkCounter(keep_names=True) as counter:
        out = engine.generate([[5, 6, 7, 8], [9, 10, 11]], 24, params=params, seed=1)
    return max(o.stats.steps for o in out), counter.read_names, counter.host_reads


@pytest.mark.parametrize("method", ["eagle2", "static", "chain"])
def test_sampled_steps_read_twice(method):
    """At T = 1 a step reads the device twice: the tree walk's inputs (one transfer) and the verdict;
    learning the positional rates of drawn children reads nothing more (the verdict's read carries the tree)."""
    policy = make_policy(method, **({"depth": 3, "top_k": 3, "total_tokens": 8} if method == "eagle2" else {}))
    steps, reads, total = _sampled_reads(policy)
    assert reads["tolist"] <= steps and reads["cpu"] <= steps, reads  # the verdict; the walk's inputs (chains: on the device)
    assert reads["item"] <= 2 * (steps * (1 + 4) // 64 + 1), reads
    assert sum(reads.values()) == total
    if method == "eagle2":
        assert policy.ranks.observations > 0  # it did learn from the verdicts


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_ulp_follows_the_dtype():
    assert ulp(1.0, torch.bfloat16) == pytest.approx(2**-7)
    assert ulp(10.0, torch.bfloat16) == pytest.approx(2**-7 * 8)
    assert ulp(10.0, torch.float32) == pytest.approx(2**-23 * 8)


class _FixedLogits(torch.nn.Module):
    """A stand-in causal LM whose last-position logits are fixed."""

    def __init__(self, logits: list[float], dtype: torch.dtype) -> None:
        super().__init__()
        self.z = torch.nn.Parameter(torch.tensor(logits, dtype=dtype), requires_grad=False)

    def forward(self, input_ids, logits_to_keep=1):
        class Out:
            logits = self.z.expand(input_ids.shape[0], 1, -1)

        return Out()


@pytest.mark.parametrize(
    ("logits", "dtype", "kind"),
    [
        ([0.0, 12.0, 12.0 - 2**-7 * 8, -3.0], torch.bfloat16, "numerical tie"),  # one bf16 ulp apart at 12
        ([0.0, 12.0, 11.0, -3.0], torch.bfloat16, "mismatch"),
        ([0.0, 12.0, 12.0 - 2**-7 * 8, -3.0], torch.float32, "mismatch"),  # float32 resolves the same gap easily
    ],
)
def test_divergence_classification(logits, dtype, kind):
    model = _FixedLogits(logits, dtype)
    div = classify(model, [4, 5], output=[7, 2, 0], reference=[7, 1, 0])  # AR chose 1, the method 2, at position 1
    assert div is not None
    assert (div.position, div.ar_token, div.method_token) == (1, 1, 2)
    assert div.kind == kind
    assert div.tolerance == pytest.approx(TIE_ULPS * ulp(12.0, dtype))


def test_no_divergence_when_one_output_only_stops_earlier():
    assert classify(_FixedLogits([0.0, 1.0], torch.float32), [1], output=[1, 1], reference=[1, 1, 0]) is None


def test_host_context_lengths_match_the_cache():
    """Policies read committed lengths from the host (`DraftContext.host_context_len`); they must equal the cache's."""
    target = sharpen(tiny_model("llama", seed=0))
    draft = sharpen(tiny_model("llama", seed=1, layers=1))
    engine = SpeculativeEngine(target, ChainPolicy(k=3), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
    session = engine.session(max_rows=2)
    for prompt, budget in (([5, 6, 7, 8], 20), ([9, 10], 7), ([11, 12, 13], 15)):
        session.submit(prompt, budget)
    while not session.idle:
        session.step()
        if session.rows:
            live = [r for r, req in enumerate(session.rows) if not req.done]
            host = session._host_context_lens()
            device = engine.target.committed_len().tolist()
            assert [host[r] for r in live] == [device[r] for r in live]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only path: SDPA without cuDNN, forward timing by CUDA events")
@pytest.mark.parametrize("method", ["ar", "chain", "eagle2"])
def test_cuda_greedy_equals_generate_and_times_forwards_when_asked(method, monkeypatch):
    options = {"ar": {}, "chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}}[method]
    target = sharpen(tiny_model("llama", seed=0)).cuda()
    draft = sharpen(tiny_model("llama", seed=0)).cuda()
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        ref = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
    for timed in (False, True):  # CUDA's default: untimed; SPECDEC_TIME_FORWARDS=1: two events a forward
        monkeypatch.setenv(FORWARD_TIMING_ENV, "1" if timed else "")
        engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
        result = engine.generate([prompt], 16)[0]
        assert result.token_ids == ref
        assert (engine.target.forward_s > 0) == timed  # read from CUDA events
        efficiency = result.stats.engine_efficiency
        assert (efficiency is None) if not timed else (efficiency is not None and 0 < efficiency <= 1)


def test_forward_timing_is_on_for_cpus_off_for_cuda_unless_the_environment_says():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert forward_timing_default(cpu, {}) and not forward_timing_default(cuda, {})
    assert forward_timing_default(cuda, {FORWARD_TIMING_ENV: "1"}) and forward_timing_default(cuda, {FORWARD_TIMING_ENV: " On "})
    assert not forward_timing_default(cpu, {FORWARD_TIMING_ENV: "0"}) and not forward_timing_default(cpu, {FORWARD_TIMING_ENV: "off"})
    assert forward_timing_default(cpu, {FORWARD_TIMING_ENV: ""})  # empty: unset
    with pytest.raises(SpecDecError, match=f"{FORWARD_TIMING_ENV}='sometimes' is not understood; set it to 1"):
        forward_timing_default(cpu, {FORWARD_TIMING_ENV: "sometimes"})


def test_level_capture_setting_reads_all_none_or_the_default():
    from specdec.models.runner import CAPTURE_LEVELS_ENV, capture_levels_default

    assert capture_levels_default({}) is None and capture_levels_default({CAPTURE_LEVELS_ENV: ""}) is None  # unset: sampled steps, not CAST's
    assert capture_levels_default({CAPTURE_LEVELS_ENV: "0"}) is False and capture_levels_default({CAPTURE_LEVELS_ENV: "off"}) is False
    assert capture_levels_default({CAPTURE_LEVELS_ENV: "1"}) is True and capture_levels_default({CAPTURE_LEVELS_ENV: "yes"}) is True
    with pytest.raises(SpecDecError, match=f"{CAPTURE_LEVELS_ENV}='2' is not understood; set it to 1 \\(capture every drafting level"):
        capture_levels_default({CAPTURE_LEVELS_ENV: "2"})
    # a CPU runner never has level graphs (they need CUDA graphs), whatever the environment
    assert ModelRunner(sharpen(tiny_model("llama", seed=0)), static_shapes=True).level_graphs is None


def test_walk_capture_setting_reads_on_unless_zero():
    from specdec.models.runner import CAPTURE_WALKS_ENV, capture_walks_default

    assert capture_walks_default({}) and capture_walks_default({CAPTURE_WALKS_ENV: "1"})  # on with CUDA graphs unless turned off
    assert not capture_walks_default({CAPTURE_WALKS_ENV: "0"}) and not capture_walks_default({CAPTURE_WALKS_ENV: "off"})
    with pytest.raises(SpecDecError, match=f"{CAPTURE_WALKS_ENV}='maybe' is not understood; set it to 1 \\(capture the verification walk"):
        capture_walks_default({CAPTURE_WALKS_ENV: "maybe"})
    # a CPU runner never has walk graphs (they need CUDA graphs), whatever the environment
    assert ModelRunner(sharpen(tiny_model("llama", seed=0)), static_shapes=True).walk_graphs is None


def test_untimed_forwards_leave_engine_efficiency_unmeasured_and_output_unchanged(monkeypatch):
    target, draft = sharpen(tiny_model("llama", seed=0)), sharpen(tiny_model("llama", seed=1))
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    results = {}
    for timed in (True, False):
        monkeypatch.setenv(FORWARD_TIMING_ENV, "1" if timed else "0")
        engine = SpeculativeEngine(target, make_policy("eagle2", depth=3, top_k=2, total_tokens=6), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[])
        assert engine.target.time_forwards == timed
        results[timed] = engine.generate(prompts, 12, batch_size=2)
        assert (engine.target.forward_s > 0) == timed
    assert [r.token_ids for r in results[True]] == [r.token_ids for r in results[False]]
    assert all(r.stats.engine_efficiency is not None and 0 < r.stats.engine_efficiency <= 1 for r in results[True])
    assert all(r.stats.engine_efficiency is None and r.stats.summary()["engine_efficiency"] is None for r in results[False])


def calibration_refits(updates: int) -> int:
    """How many times an `AcceptanceCalibrator` refits its table (one read each) in `updates` updates."""
    refitted = count = 0
    for update in range(1, updates + 1):
        if update <= calibration.EARLY_REFITS or update - refitted >= min(calibration.REFIT_EVERY, max(1, refitted // calibration.REFIT_GROWTH)):
            refitted, count = update, count + 1
    return count


def test_sampled_dynatree_reads_once_per_level():
    """Drawn children: DynaTree's levels keep a static width (no read of their own); what it reads is
    one count per drafted level, the walk's inputs and the verdict, and the calibration table's
    counts when it is refitted (after each of the first few steps, then further and further apart)."""
    policy = make_policy("dynatree")
    steps, reads, _ = _sampled_reads(policy)
    assert reads["__int__"] == 0, reads  # no width read per level
    assert steps < reads["cpu"] <= steps + calibration_refits(steps), reads  # the walk's inputs once per step, and the refits
    assert reads["tolist"] <= steps * (policy.d_max + 2), reads  # a count per level, the verdict, the history rule


def test_sampled_trees_tested_on_the_device_copy_nothing_large():
    """At T > 0 the host walk copies every node's target and draft distribution each step
    (2 x 4 x N x V bytes a row); the device tests copy only the verdict (a vocabulary of 1024, so
    that one distribution, 4 KB, is far more than the verdict's few hundred bytes a step)."""
    target = tiny_model("llama", seed=0, vocab=1024)
    draft = tiny_model("llama", seed=1, layers=1, vocab=1024)
    vocab = target.config.vocab_size
    per_step = {}
    for walk in ("host", "device"):
        policy = Eagle2Policy(depth=3, top_k=3, total_tokens=8)
        engine = SpeculativeEngine(target, policy, SamplingRule(walk=walk), ModelDraftSource(draft), eos_token_ids=[])
        with HostWorkCounter() as counter:
            out = engine.generate([[5, 6, 7, 8], [9, 10, 11]], 12, SamplingParams(temperature=1.0), seed=0)
        per_step[walk] = counter.host_bytes / max(o.stats.steps for o in out)
    assert per_step["host"] >= 2 * 4 * 2 * vocab  # at least a root and one child's distributions, target and draft, per row
    assert per_step["device"] < 4 * vocab  # the verdict's indices: less than one distribution


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_host_copy_holds_the_values_of_its_start_and_is_no_read(device):
    """`HostCopy` takes the values as they are when it starts (later writes to the device tensor
    do not reach it, also with the copy still in flight on a GPU) and is no host read for the
    counter (its wait is an event, not a `.tolist()` of a device tensor)."""
    values = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    with HostWorkCounter() as counter:
        values.mul_(2)
        copy = HostCopy(values)
        values.add_(100)  # queued after the copy
        host = copy.wait()
    assert counter.host_reads == 0
    assert host.tolist() == (torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2).tolist()
    assert HostCopy(torch.ones(2, dtype=torch.bfloat16, device=device)).wait().tolist() == [1.0, 1.0]
