"""Static-shape forwards (the capturable mode CUDA graphs replay) equal the dynamic ones; CUDA
graph capture, replay and fallback (those tests skip without CUDA); the --cuda-graphs flag."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import ARCHS, EOS, cast_level_options, decode_in_session, needs_serve, sharpen, tiny_any_config, tiny_config, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.models.graphs import resolve_cuda_graphs
from specdec.models.runner import ModelRunner
from specdec.models.static import BUCKETS, MAX_OVERSIZE, OVERSIZE_SLACK, StoragePool, node_bucket
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

SLIDING_ARCHS = ("mistral", "gemma2", "gpt_oss")
"""sliding windows of 2 slots (every layer, mixed with full layers, mixed with attention sinks): the scripted steps cross them"""
OTHER_CACHE_ARCHS = ("deepseek_v3", "gemma3n_text")
"""keys and values of different shapes in the cache (latent attention); layers with no cache of
their own (KV sharing)"""


def _model(arch: str):
    if arch in ARCHS:
        return tiny_model(arch, seed=0)
    torch.manual_seed(0)
    config = tiny_any_config(arch)
    if arch in SLIDING_ARCHS:
        config.sliding_window = 2
    return AutoModelForCausalLM.from_config(config).eval()


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def committed_keys(runner: ModelRunner, row: int) -> list[torch.Tensor]:
    """Per layer: keys and values of the valid committed slots of `row`."""
    valid = runner.slot_valid[row]
    return [t[row][:, : runner.past_len][:, valid] for layer in range(runner.num_layers) for t in runner.cache.kv(layer)]


def scripted_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill two left-padded rows, a tree step (root + 2 levels), a commit with a hole, a
    step that is rolled back and one more; returns every forward's logits."""
    dev = runner.device
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], device=dev)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=dev)
    out = [runner.prefill(ids, mask)]
    base = runner.committed_len()[:, None]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=dev).expand(2, 3, 3)  # root, two children
    out.append(runner.forward(torch.tensor([[9, 10, 11], [12, 13, 14]], device=dev), base + torch.tensor([0, 1, 1], device=dev), tree))
    level = torch.tensor([[[1, 1, 0], [1, 0, 1]]], dtype=torch.bool, device=dev).expand(2, 2, 3)  # two grandchildren, no mutual visibility
    out.append(runner.forward(torch.tensor([[20, 21], [22, 23]], device=dev), base + 2, level))
    runner.commit(torch.tensor([[0, 1, 3], [0, 2, 4]], device=dev), torch.tensor([[True, True, True], [True, True, False]], device=dev))
    base = runner.committed_len()[:, None]
    one = torch.ones(2, 1, 1, dtype=torch.bool, device=dev)
    out.append(runner.forward(torch.tensor([[30], [31]], device=dev), base, one))
    runner.rollback()
    out.append(runner.forward(torch.tensor([[32], [33]], device=dev), base, one))
    runner.commit(torch.zeros(2, 1, dtype=torch.long, device=dev), torch.ones(2, 1, dtype=torch.bool, device=dev))
    return out


@pytest.mark.parametrize("arch", ARCHS + SLIDING_ARCHS + OTHER_CACHE_ARCHS)
def test_static_forwards_equal_dynamic(arch):
    model = sharpen(_model(arch))
    dynamic, static = ModelRunner(model), ModelRunner(model, static_shapes=True)
    for got, ref in zip(scripted_steps(static), scripted_steps(dynamic), strict=True):
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert static.past_len == dynamic.past_len
    for row in range(2):
        for got, ref in zip(committed_keys(static, row), committed_keys(dynamic, row), strict=True):
            assert torch.allclose(got, ref, atol=1e-5)


def test_buckets():
    assert [node_bucket(n) for n in (1, 2, 3, 5, 17, 33, 49, 100, 256, 257, 300)] == [1, 2, 4, 8, 32, 48, 64, 128, 256, 384, 384]
    assert list(BUCKETS) == sorted(BUCKETS)


def test_bucket_padding_never_committed():
    """A forward of 3 tokens runs as 4; the padding token's slot is never numbered as a step
    slot (step_len advances by 3), the next forward overwrites it, and commits equal dynamic ones."""
    model = sharpen(tiny_model("llama", seed=0))
    runners = ModelRunner(model), ModelRunner(model, static_shapes=True)
    for runner in runners:
        ids = torch.tensor([[3, 4, 5]])
        runner.prefill(ids, torch.ones_like(ids))
        runner.forward(torch.tensor([[6, 7, 8]]), torch.tensor([[3, 4, 4]]), torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
        assert runner.step_len == 3
        runner.forward(torch.tensor([[9]]), torch.tensor([[5]]), torch.tensor([[[1, 1, 0]]], dtype=torch.bool))  # writes step slot 3 (the padding's)
        assert runner.step_len == 4
        runner.commit(torch.tensor([[0, 1, 3]]), torch.ones(1, 3, dtype=torch.bool))
    for got, ref in zip(committed_keys(runners[1], 0), committed_keys(runners[0], 0), strict=True):
        assert torch.allclose(got, ref, atol=1e-5)
    # the padding token of a 3-token forward (bucket 4) in a fresh step: its slot is past step_len, so a commit cannot reach it
    static = runners[1]
    static.forward(torch.tensor([[10, 11, 12]]), torch.tensor([[6, 7, 7]]), torch.ones(1, 3, 3, dtype=torch.bool).tril())
    static.commit(torch.tensor([[0, 1, 2, 5]]), torch.ones(1, 4, dtype=torch.bool))  # an out-of-range index is clamped to the last real slot
    assert static.past_len == 10


class _FlagHostReads(TorchDispatchMode):
    """Records ops that read device values on the host or have data-dependent output shapes."""

    FLAGGED = ("_local_scalar_dense", "nonzero", "masked_select", "item", "_unique2", "unique_consecutive", "unique_dim")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in self.FLAGGED or (name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ARCHS)
def test_no_host_reads_in_static_forwards(arch):
    """Everything a static forward does, the model call included, runs without a host read."""
    model = tiny_model(arch, seed=0)
    runner = ModelRunner(model, static_shapes=True)
    ids = torch.tensor([[0, 5, 6, 7], [3, 4, 5, 6]])
    runner.prefill(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    base = runner.committed_len()[:, None]
    with _FlagHostReads() as flags:
        runner.forward(torch.tensor([[9, 10, 11], [12, 13, 14]]), base + torch.tensor([0, 1, 1]), torch.ones(2, 3, 3, dtype=torch.bool).tril())
        runner.forward(torch.tensor([[20], [21]]), base + 2, torch.ones(2, 1, 3, dtype=torch.bool))
        runner.commit(torch.tensor([[0, 1], [0, 2]]), torch.ones(2, 2, dtype=torch.bool))
    assert flags.seen == []


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47], [20, 21]]
METHODS = {"chain": {"k": 4}, "static": {"depth": 3, "branching": 2, "max_nodes": 12}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}}


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_with_static_shapes_equals_target(arch, batch_size):
    target = sharpen(tiny_model(arch, seed=0))
    draft = sharpen(tiny_model(arch, seed=0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    refs = [reference(target, p, 20) for p in PROMPTS]
    for method, options in METHODS.items():
        engine = SpeculativeEngine(
            target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True
        )
        outs = engine.generate(PROMPTS, 20, batch_size=batch_size)
        assert [o.token_ids for o in outs] == refs, f"{arch}/{method}/B={batch_size}"


def _batch_sizes_while_rows_finish(target, draft, prompts, budgets, static: bool) -> list[int]:
    """Decode `prompts` (with their token budgets) in one session of a chain with static shapes
    on or off; assert each output equals the prompt decoded alone; return the batch size of every step."""

    def engine() -> SpeculativeEngine:
        return SpeculativeEngine(
            target, make_policy("chain", k=3), GreedyRule(), ModelDraftSource(draft, static_shapes=static), eos_token_ids=[], static_shapes=static
        )

    alone = [engine().generate([p], n)[0].token_ids for p, n in zip(prompts, budgets, strict=True)]
    outputs, sizes = decode_in_session(engine(), prompts, budgets, max_rows=len(prompts))
    assert outputs == alone
    return sizes


@pytest.mark.parametrize("static", [False, True])
def test_static_shapes_keep_the_batch_size_while_rows_finish(static):
    """With static shapes (CUDA graphs) finished rows ride along inactive until every row has
    finished: the batch keeps its size, so no forward takes a new shape (on a GPU a graph captured
    mid-call at every size a shrinking batch passes through). Without them finished rows leave.
    Either way each output equals the prompt decoded alone."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1)
    sizes = _batch_sizes_while_rows_finish(target, draft, PROMPTS[:3], [3, 9, 15], static)
    assert sizes[0] == 3 and sizes[-1] == (3 if static else 1), sizes
    assert (set(sizes) == {3}) if static else (sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3)


def test_finished_rows_near_the_context_end_leave_instead_of_riding():
    """A finished row that rides along grows by its root each step; near the end of a model's
    learned positions (GPT-2's position table) it would index past them, so there it leaves
    the batch as without static shapes, and decoding goes on exactly."""
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("gpt2", max_pos=48)).eval()
    torch.manual_seed(1)
    draft = AutoModelForCausalLM.from_config(tiny_config("gpt2", max_pos=48, layers=1)).eval()
    prompts, budgets = [list(range(3, 33)), [5, 6, 7, 8, 9]], [15, 40]  # the first ends at 45 of 48 positions
    assert _batch_sizes_while_rows_finish(target, draft, prompts, budgets, static=True)[-1] == 1  # the first row left once it finished


def test_a_rider_counts_every_step_since_it_finished():
    """A row that finished at admission (step 0) has grown by one slot a step since: that growth
    counts towards the context limit like any other rider's."""
    from specdec.engine import DecodeRequest

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("gpt2", max_pos=48)).eval()
    session = SpeculativeEngine(target, make_policy("ar"), GreedyRule(), None, static_shapes=True).session()
    finished = DecodeRequest(index=0, prompt=list(range(3, 33)), max_new_tokens=1, token_ids=[7], finish_reason="length", finished_step=0)
    running = DecodeRequest(index=1, prompt=[5, 6], max_new_tokens=20, token_ids=[8] * 10)
    session.rows = [finished, running]
    session.steps = 0
    assert session._riders_fit()  # 31 tokens + 10 left + 1 <= 48
    session.steps = 8  # ridden 8 steps: 39 + 10 + 1 > 48
    assert not session._riders_fit()


def test_storage_is_reused_across_runners():
    """A new runner of the same model takes the storage a released one left (graph addresses repeat)."""
    model = tiny_model("llama", seed=0)
    first = ModelRunner(model, static_shapes=True)
    ids = torch.tensor([[3, 4, 5]])
    first.prefill(ids, torch.ones_like(ids))
    address = first.cache.storage.data_ptr()
    del first
    second = ModelRunner(model, static_shapes=True)
    second.prefill(torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.long))
    assert second.cache.storage.data_ptr() == address
    # and the stale contents stay hidden: same logits as a dynamic runner
    step = torch.tensor([[9, 10]]), torch.tensor([[2, 3]]), torch.ones(1, 2, 2, dtype=torch.bool).tril()
    ref = ModelRunner(model)
    ref.prefill(torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.long))
    assert torch.allclose(second.forward(*step), ref.forward(*step), atol=1e-5)


def test_cpu_runners_reuse_released_storage_and_its_stale_values_stay_hidden():
    """Without static shapes, on a CPU, a new cache takes the storage a released one left (no
    fresh pages to fault in per call); its stale keys and values are never attended to: the
    logits equal those of a runner on fresh (zeroed) storage."""
    model = tiny_model("llama", seed=0)
    first = ModelRunner(model)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    first.prefill(ids, torch.ones_like(ids))
    address = first.cache.storage.data_ptr()
    first.reset(2)  # the storage goes back to the model's pool
    prompt = torch.tensor([[7, 8], [5, 6]])
    first.prefill(prompt, torch.ones_like(prompt))
    assert first.cache.storage.data_ptr() == address
    step = torch.tensor([[9, 10], [11, 12]]), torch.tensor([[2, 3], [2, 3]]), torch.ones(2, 2, 2, dtype=torch.bool).tril()
    fresh = ModelRunner(model)
    fresh._pool = None  # zeroed storage of its own
    fresh.prefill(prompt, torch.ones_like(prompt))
    assert fresh.cache.storage.data_ptr() != address
    assert torch.equal(first.forward(*step), fresh.forward(*step))


def test_cpu_storage_is_reused_after_the_batch_shrank_and_at_another_width():
    """A batch that shrank (`keep_rows` narrows the storage to its first rows as rows finish) gives
    back its whole storage, and the next call's cache, of more rows and another prompt width (no
    exact shape in common), takes it: the old pool matched shapes exactly, so a grouped call at
    B = 16 zeroed fresh storage for each cache. The stale values stay hidden: the logits equal a
    runner's on fresh storage."""
    model = tiny_model("llama", seed=0)
    first = ModelRunner(model)
    first._pool = StoragePool(max_bytes=2**30, by_bytes=True)  # this test's own, as `cpu_pool` makes them
    ids = torch.randint(3, 60, (4, 9))
    first.prefill(ids, torch.ones_like(ids))
    address = first.cache.storage.data_ptr()
    first.keep_rows([0, 1])  # two rows finished: the storage is a view of the first two rows now
    assert first.cache.storage.shape[2] == 2 and first.cache.storage.data_ptr() == address
    first.reset(3)  # the call ended; a new batch of 3 rows, 5-token prompts
    prompt = torch.randint(3, 60, (3, 5))
    first.prefill(prompt, torch.ones_like(prompt))
    assert first.cache.storage.data_ptr() == address and first.cache.storage.shape[2] == 3
    fresh = ModelRunner(model)
    fresh._pool = None  # zeroed storage of its own
    fresh.prefill(prompt, torch.ones_like(prompt))
    step = torch.randint(3, 60, (3, 2)), torch.tensor([[5, 6]] * 3), torch.ones(3, 2, 2, dtype=torch.bool).tril()
    assert torch.equal(first.forward(*step), fresh.forward(*step))


def test_a_pool_by_bytes_serves_the_smallest_fitting_storage_of_the_same_dtype():
    pool = StoragePool(max_bytes=10**6, by_bytes=True)
    small, large, halves = torch.zeros(2, 50), torch.zeros(4, 100), torch.zeros(300, dtype=torch.float16)
    pool.give([(large.narrow(0, 0, 1), 0, 1), (small, 0, 1), (large, 0, 1), (halves, 0, 0)])  # `large` twice: kept once
    assert sorted(t.numel() for t, _, _ in pool.free) == [100, 300, 400]
    pool.give([(small, 0, 1)])  # given again while pooled: still one entry, never lent twice
    assert sorted(t.numel() for t, _, _ in pool.free) == [100, 300, 400]
    cpu = torch.device("cpu")
    taken = pool.take((3, 30), torch.float32, cpu)  # 90 elements: `small` is the smallest that holds them
    assert taken is not None and taken.shape == (3, 30) and taken.is_contiguous() and taken.data_ptr() == small.data_ptr()
    assert pool.take((2, 150), torch.float32, cpu).data_ptr() == large.data_ptr()  # 300 of 400
    assert pool.take((2, 150), torch.float32, cpu) is None  # the float16 storage is not lent as float32
    assert pool.take((10, 30), torch.float16, cpu).data_ptr() == halves.data_ptr()
    assert pool.capacity_for(2, 64) is None  # any width fits some storage: the asked one stands
    huge = torch.zeros(MAX_OVERSIZE * 1000 + OVERSIZE_SLACK + 1)
    pool.give([(huge, 0, 0)])
    assert pool.take((1000,), torch.float32, cpu) is None  # a small cache would hold it from a large one
    assert pool.take((1001,), torch.float32, cpu).data_ptr() == huge.data_ptr()


def test_storage_pool_keeps_its_byte_budget():
    from specdec.models.static import StoragePool

    pool = StoragePool(max_bytes=3 * 400)
    tensors = [torch.zeros(100) for _ in range(4)]  # 400 bytes each
    pool.give([(t, 0, 0) for t in tensors[:2]])
    pool.give([(tensors[2], 0, 0), (tensors[3], 0, 0)])
    assert [id(t) for t, _, _ in pool.free] == [id(t) for t in tensors[1:]]  # the oldest went first
    assert pool.take((100,), torch.float32, torch.device("cpu")) is tensors[3]
    assert pool.take((101,), torch.float32, torch.device("cpu")) is None


def test_warm_up_runs_every_bucket():
    model = tiny_model("llama", seed=0)
    engine = SpeculativeEngine(model, make_policy("chain", k=4), GreedyRule(), ModelDraftSource(tiny_model("llama", seed=1), static_shapes=True), static_shapes=True)
    assert engine.warm_up([1, 2], context=32, max_tokens=8) == 2 * 2 * 4  # two models, two batch sizes, buckets 1, 2, 4, 8
    out = engine.generate([PROMPTS[0]], 6)[0]
    assert out.token_ids == reference(model, PROMPTS[0], 6)
    plain = SpeculativeEngine(model, make_policy("ar"), GreedyRule(), None)
    assert plain.warm_up([1]) == 0


def test_default_warm_up_covers_the_default_trees():
    """By default `warm_up` captures every bucket the default trees verify at batch 1, so none is
    captured inside a timed call: CAST's 72 draft tokens and the root (bucket 96; the old default
    of 64 left it out), DynaTree's widest measured free width and the root, EAGLE-2's 32 and the root."""
    from specdec.drafting.dynatree import MEASURED_FREE_CAP
    from specdec.models.static import WARM_UP_TOKENS

    widest = [1 + make_policy("cast").total_tokens, MEASURED_FREE_CAP, 1 + make_policy("eagle2").total_tokens, 1 + make_policy("chain").k]
    assert all(node_bucket(n) <= node_bucket(WARM_UP_TOKENS) for n in widest), (widest, WARM_UP_TOKENS)


# ----- the option -------------------------------------------------------------------------
def test_resolve_cuda_graphs():
    assert resolve_cuda_graphs("auto", "cpu") is False
    assert resolve_cuda_graphs("off", "cpu") is False
    assert resolve_cuda_graphs("auto", "cuda:0") is True
    with pytest.raises(SpecDecError, match="--cuda-graphs on needs a CUDA device; the device is cpu; use auto or off"):
        resolve_cuda_graphs("on", "cpu")
    with pytest.raises(SpecDecError, match="must be one of"):
        resolve_cuda_graphs("sometimes", "cpu")


def test_api_cuda_graphs_on_cpu(tiny_pair_dir):
    with pytest.raises(SpecDecError, match="needs a CUDA device"):
        SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu", cuda_graphs="on")
    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu", static_shapes=True)
    assert decoder.cuda_graphs is False and decoder.static_shapes is True
    engine = decoder.engine("greedy")
    assert engine.target.static_shapes and engine.source.runner.static_shapes


@pytest.mark.parametrize("command", ["generate", "bench", pytest.param("serve", marks=needs_serve), "profile"])
def test_cli_cuda_graphs_on_without_cuda(capsys, command, tmp_path):
    extra = {"generate": ["--prompt", "x"], "bench": ["--out", str(tmp_path / "b")], "serve": ["--port", "0"], "profile": ["--out", str(tmp_path / "p.json")]}[command]
    try:
        code = main([command, "--device", "cpu", "--cuda-graphs", "on", *extra])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--cuda-graphs on needs a CUDA device; the device is cpu; use auto or off" in err


def test_cli_cuda_graphs_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--cuda-graphs", "maybe"])
    assert exit_.value.code == 2
    assert "--cuda-graphs" in capsys.readouterr().err


# ----- CUDA only ------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_graph_replay_equals_eager(arch):
    model = sharpen(tiny_model(arch, seed=0)).cuda()
    graphed, eager = ModelRunner(model, cuda_graphs=True), ModelRunner(model)
    for _ in range(2):  # the second pass replays the graphs the first captured
        for got, ref in zip(scripted_steps(graphed), scripted_steps(eager), strict=True):
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert graphed.graphs is not None and graphed.graphs.failed is None
    assert graphed.graphs.captures > 0 and graphed.graphs.replays > 0


@needs_cuda
def test_graphs_are_captured_after_every_earlier_graph_is_gone():
    """The graph pool outlives the graphs captured into it. Before its anchor graph, a model
    captured after every earlier model's graphs were freed (a bench's next method, a server's
    next model) hit the caching allocator's `use_count > 0` assert and ran eagerly for good
    (seen on an H100: test_graph_replay_equals_eager[gpt2] after [llama] in one process)."""
    for arch in ("llama", "gpt2", "llama"):
        model = sharpen(tiny_model(arch, seed=0)).cuda()
        graphed, eager = ModelRunner(model, cuda_graphs=True), ModelRunner(model)
        for got, ref in zip(scripted_steps(graphed), scripted_steps(eager), strict=True):
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
        assert graphed.graphs is not None and graphed.graphs.failed is None and graphed.graphs.captures > 0, arch
        del model, graphed, eager
        gc.collect()
        torch.cuda.empty_cache()


@needs_cuda
def test_greedy_with_cuda_graphs_equals_target():
    target = sharpen(tiny_model("llama", seed=0)).cuda()
    draft = sharpen(tiny_model("llama", seed=0)).cuda()
    refs = [reference(target.cpu(), p, 16) for p in PROMPTS]
    target.cuda()
    for method, options in METHODS.items():
        engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft, cuda_graphs=True), eos_token_ids=[EOS], cuda_graphs=True)
        outs = engine.generate(PROMPTS, 16, batch_size=3)
        assert [o.token_ids for o in outs] == refs, method


def _level_capture_pair(monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, torch.nn.Module]:
    """SPECDEC_CAPTURE_LEVELS=1 with untimed forwards, and a close llama pair on CUDA."""
    monkeypatch.setenv("SPECDEC_CAPTURE_LEVELS", "1")
    monkeypatch.setenv("SPECDEC_TIME_FORWARDS", "0")
    target = sharpen(tiny_model("llama", seed=0)).cuda()
    draft = sharpen(tiny_model("llama", seed=0)).cuda()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return target, draft


def _level_options(method: str) -> dict[str, Any]:
    """A level-capture test's options: DynaTree inside a free width, CAST deterministic (its plans
    do not follow wall-clock times, so both modes draft alike) on a GPU-like synthetic table."""
    if method == "dynatree":
        return {"free_tokens": 24}
    if method == "cast":
        return cast_level_options()
    return METHODS[method]


@needs_cuda
@pytest.mark.parametrize("method", ["chain", "static", "eagle2", "dynatree", "cast"])
def test_captured_levels_on_cuda_equal_target(method, monkeypatch):
    """SPECDEC_CAPTURE_LEVELS=1: whole drafting levels replay as CUDA graphs; greedy output is the
    target's, the drafts are the op-by-op ones (the same steps), and no level graph was given up."""
    target, draft = _level_capture_pair(monkeypatch)
    refs = [reference(target.cpu(), p, 24) for p in PROMPTS]
    target.cuda()
    runs = _captured_and_op_by_op(target, draft, method, GreedyRule(), lambda engine: engine.generate(PROMPTS, 24, batch_size=3))
    for capture, calls in zip((True, False), runs, strict=True):
        for outs in calls:
            assert [o.token_ids for o in outs] == refs, (method, capture)
    assert [o.stats.steps for o in runs[0][1]] == [o.stats.steps for o in runs[1][1]]


def _captured_and_op_by_op(target: Any, draft: Any, method: str, rule: Any, call: Callable[[SpeculativeEngine], Any]) -> list[Any]:
    """`call(engine)` twice (the second replays what the first captured) with the method's levels
    captured, then with them op by op: [[first, second] captured, [first, second] op by op]. Checks
    that levels were captured and replayed and that no level graph was given up."""
    results = []
    for capture in (True, False):
        source = ModelDraftSource(draft, cuda_graphs=True)
        if not capture:
            source.runner.level_graphs = None
        engine = SpeculativeEngine(target, make_policy(method, **_level_options(method)), rule, source, eos_token_ids=[EOS], cuda_graphs=True)
        results.append([call(engine), call(engine)])
        if capture:
            levels = source.runner.level_graphs
            assert levels is not None and levels.failed is None and levels.captures > 0 and levels.replays > 0
    return results


@needs_cuda
@pytest.mark.parametrize("method", ["chain", "static", "eagle2", "dynatree"])
def test_captured_sampled_levels_on_cuda_draw_as_op_by_op(method, monkeypatch):
    """Sampled children in captured levels on CUDA (T = 0.8, top-p 0.9, one seed): each level's
    random numbers are drawn outside its graph as op-by-op drafting draws them, so the output and
    the steps are the op-by-op ones, and no level graph was given up."""
    from specdec.sampling import SamplingParams
    from specdec.verification.sampling import SamplingRule

    target, draft = _level_capture_pair(monkeypatch)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    runs = _captured_and_op_by_op(target, draft, method, SamplingRule(), lambda engine: engine.generate(PROMPTS, 24, params=params, seed=7, batch_size=3))
    captured, op_by_op = ([(o.token_ids, o.stats.steps) for o in calls[1]] for calls in runs)
    assert captured == op_by_op


def _walks_captured_and_op_by_op(target: Any, draft: Any, method: str, rule: Callable[[], Any], params: Any) -> list[Any]:
    """The second of two calls (the first captures) with the target's walks captured, then op by
    op: [(tokens, steps, relaxed tokens) per prompt] each. Checks that walk graphs were captured
    and replayed and none was given up."""
    results = []
    for capture in (True, False):
        engine = SpeculativeEngine(target, make_policy(method, **_level_options(method)), rule(), ModelDraftSource(draft, cuda_graphs=True), eos_token_ids=[EOS], cuda_graphs=True)
        if not capture:
            engine.target.walk_graphs = None
        calls = [engine.generate(PROMPTS * 2, 48, params=params, seed=7, batch_size=3) for _ in range(2)]  # the second replays
        results.append([(o.token_ids, o.stats.steps, o.stats.relaxed_tokens) for o in calls[1]])
        if capture:
            walks = engine.target.walk_graphs
            assert walks is not None and walks.failed is None and walks.captures > 0 and walks.replays > 0, walks and (walks.failed, walks.captures, walks.replays)
    return results


@needs_cuda
@pytest.mark.parametrize("method", ["static", "eagle2", "dynatree"])
def test_captured_walks_on_cuda_verify_as_op_by_op(method, monkeypatch):
    """Sampled trees tested on the device by traversal, their plan and walk replayed as CUDA
    graphs (the default with graphs, `specdec.verification.captured`), against the walk op by op:
    the same output and steps at T = 0.8, top-p 0.9, one seed (the walk's random numbers are drawn
    outside its graph as op by op draws them), and no walk graph was given up."""
    from specdec.sampling import SamplingParams
    from specdec.verification.sampling import SamplingRule

    target, draft = _level_capture_pair(monkeypatch)
    captured, op_by_op = _walks_captured_and_op_by_op(target, draft, method, SamplingRule, SamplingParams(temperature=0.8, top_p=0.9))
    assert captured == op_by_op


@needs_cuda
def test_captured_mars_tests_on_cuda_verify_as_op_by_op(monkeypatch):
    """MARS at T = 1 (theta 0.9) tested on the device as one CUDA graph replay a step against op
    by op: the same output, steps and relaxed counts for a seed, no graph given up."""
    from specdec.sampling import SamplingParams
    from specdec.verification.mars import MarsRule

    target, draft = _level_capture_pair(monkeypatch)
    captured, op_by_op = _walks_captured_and_op_by_op(target, draft, "eagle2", lambda: MarsRule(theta=0.9), SamplingParams(temperature=1.0))
    assert captured == op_by_op


@needs_cuda
def test_capture_failure_falls_back_once(caplog):
    """A forward that reads a device value on the host cannot be captured: one warning naming
    the model class, then eager forwards with the same results."""
    model = sharpen(tiny_model("llama", seed=0)).cuda()
    real_forward = model.forward

    def syncing_forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].sum().item() < 0:  # a host read: not capturable
            raise AssertionError
        return real_forward(*args, **kwargs)

    model.forward = syncing_forward  # type: ignore[method-assign]
    graphed, eager = ModelRunner(model, cuda_graphs=True), ModelRunner(model)
    with caplog.at_level(logging.WARNING, logger="specdec.graphs"):
        for _ in range(2):
            for got, ref in zip(scripted_steps(graphed), scripted_steps(eager), strict=True):
                assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    warnings = [r for r in caplog.records if r.name == "specdec.graphs"]
    assert len(warnings) == 1 and "LlamaForCausalLM" in warnings[0].getMessage()
    assert graphed.graphs is not None and graphed.graphs.failed
