"""CAST cost profiles over a grid of batch sizes: interpolation in B, measuring only before
decoding (never inside a step), the bench warming its profile before timing, and mismatch
messages that name each differing field with both values."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import EOS, cli_args, tiny_model

from specdec.cli import main
from specdec.cost import CostTable, CostTableResolver, batch_grid, forget_measured, profile
from specdec.cost.profile import SHIPPED_PROFILE, ProfileSource, advice
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def pair():
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1)


# ----- the batch grid and interpolation -------------------------------------------------------


def test_batch_grid_reaches_the_largest_batch():
    assert batch_grid(1) == (1,)
    assert batch_grid(2) == (1, 2)
    assert batch_grid(5) == (1, 2, 4, 5)
    assert batch_grid(12) == (1, 2, 4, 8, 12)
    assert batch_grid(16) == (1, 2, 4, 8, 16)
    with pytest.raises(SpecDecError, match="positive integer"):
        batch_grid(0)


def test_interpolation_between_grid_batch_sizes():
    # per column f = 10 + b * n: linear in b, so interpolation between grid points is exact
    table = CostTable.synthetic(lambda b, c, n: 10 + b * n, lambda b, c, n: 1 + 0.5 * b * n, batch_sizes=(1, 2, 4, 8, 16), n_grid=(1, 2, 4, 8))
    for b in (3, 5, 6, 7, 11, 12, 15):
        for n in (1, 3, 4, 8):
            assert table.target_cost(b, 100, n) == pytest.approx(10 + b * n), (b, n)
            assert table.draft_cost(b, 100, n) == pytest.approx(1 + 0.5 * b * n), (b, n)
    # beyond the grid: the last two grid points (8, 16) extrapolated linearly
    assert table.target_cost(24, 100, 4) == pytest.approx(10 + 24 * 4)
    # on a concave curve (overhead-dominated small batches) the interpolation lies on the chord
    sqrt = CostTable.synthetic(lambda b, c, n: 10 * b**0.5 + n, lambda b, c, n: 1.0, batch_sizes=(4, 16), n_grid=(1, 2))
    assert sqrt.target_cost(10, 100, 1) == pytest.approx(20 + (40 - 20) * (10 - 4) / 12 + 1)
    assert sqrt.target_cost(2, 100, 1) == pytest.approx(21)  # below the grid: the smallest batch size's costs


def test_lookups_are_monotone_in_batch_and_n():
    # measured noise: B = 4 came out cheaper than B = 2, and B = 16 cheaper than B = 8
    dips = {1: 10.0, 2: 14.0, 4: 12.0, 8: 20.0, 16: 18.0}
    table = CostTable.synthetic(lambda b, c, n: dips[b] + n, lambda b, c, n: dips[b] / 10 + n, batch_sizes=tuple(dips), n_grid=(1, 2, 4, 8, 16))
    for n in (1, 2, 3, 8, 16, 40):
        costs = [table.target_cost(b, 300, n) for b in range(1, 41)]
        assert all(b >= a - 1e-9 for a, b in zip(costs, costs[1:], strict=False)), n
        assert table.target_cost(4, 300, n) == pytest.approx(table.target_cost(2, 300, n))  # the dip is lifted, not followed
        assert table.target_cost(40, 300, n) >= table.target_cost(16, 300, n)  # a negative slope past the grid is clamped at 0
    for b in (1, 3, 4, 12, 16, 40):
        row = table.target_costs(b, 300, 40)
        assert all(y >= x - 1e-9 for x, y in zip(row[1:], row[2:], strict=False)), b
    # the stored table keeps the measurements (only lookups are made monotone in B)
    assert table.target_ms[4][0][0] == pytest.approx(13.0)


# ----- measuring only before decoding ---------------------------------------------------------


def _forbid_measuring(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a cost measurement inside decoding")

    monkeypatch.setattr(profile, "profile_models", refuse)
    monkeypatch.setattr(profile, "measure_forward_ms", refuse)
    monkeypatch.setattr(profile, "stale_points", lambda *args, **kwargs: [])  # a kept profile's spot check passes


def test_rolling_batch_shrinking_through_uncovered_sizes_never_measures(tmp_path, monkeypatch, caplog):
    forget_measured()
    target, draft = pair()
    policy = make_policy("cast", cost_profile=str(tmp_path / "cost.json"), depth=2, top_k=3, total_tokens=6)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        policy.bind_models(target, draft)  # no profile: batch 1 measured now, as a decoder build does
        engine = SpeculativeEngine(target, policy, GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        session = engine.session(max_rows=6)  # extends the table to 1, 2, 4, 6 before any step
    assert policy.table_for(1).batch_sizes == [1, 2, 4, 6]
    assert "measuring forward costs for batch sizes 2, 4, 6 before decoding" in caplog.text
    _forbid_measuring(monkeypatch)
    seen: list[int] = []
    lookup = policy.table_for

    def record(batch: int) -> CostTable:
        seen.append(batch)
        return lookup(batch)

    monkeypatch.setattr(policy, "table_for", record)
    prompts = [[5 + r, 6, 7, 8 + r] for r in range(6)]
    budgets = [2, 5, 9, 14, 20, 27]
    requests = [session.submit(p, n) for p, n in zip(prompts, budgets, strict=True)]
    while not session.idle:
        session.step()
    assert [r.token_ids for r in requests] == [reference(target, p, n) for p, n in zip(prompts, budgets, strict=True)]
    assert set(seen) - {1, 2, 4, 6}, f"the batch never passed an uncovered size (3 or 5): {seen}"
    assert sorted(set(seen), reverse=True) == list(dict.fromkeys(seen)), seen  # it only shrank


def test_lookup_of_an_unprepared_resolver_is_an_error_not_a_measurement(monkeypatch):
    target, draft = pair()
    _forbid_measuring(monkeypatch)
    with pytest.raises(SpecDecError, match="not prepared before decoding"):
        CostTableResolver(target, draft).table_for(3)


def test_full_profile_is_extrapolated_not_extended(tmp_path, monkeypatch, caplog):
    target, draft = pair()
    table = profile.profile_models(target, draft, profile.ProfileGrid(batch_sizes=(1, 2), context_step=16, num_contexts=2, n_grid=(1, 4), warmup=0, repeats=1, min_time_ms=0.0))
    path = table.save(tmp_path / "full.json")
    _forbid_measuring(monkeypatch)
    resolver = CostTableResolver(target, draft, str(path))
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        assert resolver.prepare(8).batch_sizes == [1, 2]
    assert "holds batch sizes up to 2; costs at up to 8 rows are extrapolated" in caplog.text
    assert "--batch-sizes 1,2,4,8" in caplog.text
    assert resolver.source.kind == "file" and "extrapolated" in resolver.source.describe()


def test_profile_keeps_each_points_median_over_rounds(monkeypatch):
    """A slow spell lands in one round of a point: its median over three rounds ignores it (one
    round would keep it). Warm-up forwards run in the first round only; a tick per point and round."""
    target, draft = pair()
    calls: list[tuple[int, int, int]] = []  # (round, n, warmup)
    state = {"round": -1}

    def fake_measure(runner, context, n, warmup, repeats, generator, min_time_ms=0.0, max_repeats=25):
        if runner.model is target and n == 1 and context == 16 and runner.batch_size == 1:
            state["round"] += 1
            calls.append((state["round"], n, warmup))
            return (10.0, 30.0, 11.0)[state["round"]] if state["round"] < 3 else 99.0  # round 2 was slow
        return 100.0 * n

    monkeypatch.setattr(profile, "measure_forward_ms", fake_measure)
    ticks = []
    grid = profile.ProfileGrid(batch_sizes=(1, 2), context_step=16, num_contexts=2, n_grid=(1, 4), warmup=1, repeats=1, min_time_ms=0.0, passes=3)
    table = profile.profile_models(target, draft, grid, on_point=lambda: ticks.append(1))
    assert table.target_ms[1][0] == [11.0, 400.0]  # median of 10, 30, 11 (one round: 10 or 30)
    assert [w for _, _, w in calls] == [1, 0, 0]
    assert len(ticks) == 2 * grid.points() * 3
    assert table.meta["grid"]["passes"] == 3
    with pytest.raises(SpecDecError, match="passes=0 must be a positive integer"):
        profile.ProfileGrid(passes=0)
    assert profile.quick_grid(4).passes == 3


def test_a_forward_that_captures_graphs_is_not_timed(monkeypatch):
    """A later round of a profile runs no warm-up: if its cache is new storage, the first forward
    captures CUDA graphs, and that time is not a step's cost (emulated: the first forward
    'captures' and takes 10x as long)."""
    from specdec.models.runner import ModelRunner

    target, _ = pair()
    runner = ModelRunner(target)
    profile._fill_context(runner, 1, 16, torch.Generator().manual_seed(0))
    counter = {"captures": 0, "calls": 0}
    clock = {"now": 0.0}
    real_forward = runner.forward

    def forward(*args, **kwargs):
        counter["calls"] += 1
        if counter["calls"] == 1:
            counter["captures"] += 1
            clock["now"] += 0.05
        else:
            clock["now"] += 0.005
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "graph_captures", property(lambda self: counter["captures"]))
    monkeypatch.setattr(runner, "forward", forward)
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock["now"])
    ms = profile.measure_forward_ms(runner, 16, 1, 0, 1, torch.Generator().manual_seed(0))  # one timed forward, as a quick profile's later round
    assert ms == pytest.approx(5.0) and counter["calls"] == 2  # the capture, then the timed forward


def test_measurements_are_shared_in_process(monkeypatch):
    forget_measured()
    target, draft = pair()
    first = CostTableResolver(target, draft, progress=False)
    first.prepare(2)
    assert first.source.kind == "measured" and first.source.measured_s > 0 and first.source.batch_sizes == [1, 2]
    _forbid_measuring(monkeypatch)
    second = CostTableResolver(target, draft, progress=False)  # another decoder over the same models (a bench variant)
    assert second.prepare(2).batch_sizes == [1, 2]
    assert second.source.reused and "reused" in second.source.describe()


# ----- the bench ------------------------------------------------------------------------------


def test_bench_prepares_cast_costs_before_any_timed_call(tiny_pair_dir, tmp_path, monkeypatch):
    from specdec.bench import runner

    forget_measured()
    events: list[str] = []
    measure, generate = profile.profile_models, runner._Runner._generate

    def measured(*args, **kwargs):
        events.append("measure")
        return measure(*args, **kwargs)

    def timed(self, *args, **kwargs):
        events.append("call")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(profile, "profile_models", measured)
    monkeypatch.setattr(runner._Runner, "_generate", timed)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def add(a, b):\n", "class A:\n", "for i in range(3):\n")) + "\n")
    out = tmp_path / "out"
    argv = cli_args("bench", tiny_pair_dir, prompts, out, 6, 1, "--methods", "ar,cast", "--batch-size", "3", "--depth", "2", "--expand-top-k", "3")
    assert main(argv) == 0
    assert "measure" in events and "call" in events
    assert events.index("call") > max(i for i, e in enumerate(events) if e == "measure"), events
    results = json.loads((out / "results.json").read_text())
    source = results["cost_profiles"]["cast"]
    assert source["kind"] == "measured" and source["batch_sizes"] == [1, 2, 3] and source["measured_s"] > 0
    report = (out / "report.md").read_text()
    assert "## Cost profiles" in report and "- cast: measured before the run (" in report


# ----- mismatch messages ----------------------------------------------------------------------


def test_mismatch_names_each_field_with_both_values():
    target, draft = pair()
    table = profile.profile_models(target, draft, profile.ProfileGrid(batch_sizes=(1,), context_step=16, num_contexts=1, n_grid=(1,), warmup=0, repeats=1, min_time_ms=0.0))
    assert table.differences(target, draft) == [] and table.meta["target"]["shape"]["hidden_size"] == 32
    wider = tiny_model("llama", seed=0, hidden=64)
    text = table.mismatch(wider, draft)
    assert "target hidden size: profile 32, here 64" in text and "target intermediate size: profile 64, here 128" in text
    assert "target parameters: profile" in text and "draft" not in text
    deeper = tiny_model("llama", seed=1, layers=3)
    assert "draft layers: profile 1, here 3" in table.mismatch(target, deeper)
    assert "target vocabulary size: profile 96, here 128" in table.mismatch(tiny_model("llama", seed=0, vocab=128), draft)
    table.meta["dtype"] = "bfloat16"
    table.meta["device"] = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "threads": 8}
    diffs = table.differences(target, draft)
    assert [str(d) for d in diffs] == ["device type: profile 'cuda', here 'cpu'", "dtype: profile 'bfloat16', here 'float32'"]
    hint = advice(diffs, target, draft)
    assert "specdec profile --target" in hint and "--out FILE" in hint and "--dtype bfloat16" in hint and "--device cuda" in hint


def _profile_of_another_cpu(tmp_path, name: str):
    """A profile of the test pair whose provenance says another CPU model and thread count."""
    target, draft = pair()
    table = profile.profile_models(target, draft, profile.ProfileGrid(batch_sizes=(1, 2), context_step=16, num_contexts=1, n_grid=(1, 4), warmup=0, repeats=1, min_time_ms=0.0))
    here = dict(table.meta["device"])
    table.meta["device"] = {"type": "cpu", "name": "Intel(R) Xeon(R) Processor" if "AMD" in here["name"] else "AMD EPYC 9654", "threads": here["threads"] + 14}
    return target, draft, table, here, table.save(tmp_path / name)


def test_shipped_profile_of_another_cpu_is_replaced_by_this_machines_own_kept_for_later(tmp_path, monkeypatch, caplog, measured_cost_cache):
    """The shipped profile measured on another CPU model (or thread count) is not this machine's
    timing (on an AMD EPYC the Intel-made one left CAST at 0.93x AR where its own gave 1.02x):
    a quick profile is measured before decoding, with a warning naming both machines, and kept in
    the machine's cache, so a later process loads it without measuring."""
    forget_measured()
    target, draft, table, here, path = _profile_of_another_cpu(tmp_path, "other_cpu.json")
    monkeypatch.setattr(profile, "SHIPPED_PROFILE", path)  # as the shipped profile of the bundled pair
    resolver = CostTableResolver(target, draft, progress=False)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        measured = resolver.prepare(2)
    assert measured.batch_sizes == [1, 2] and measured.meta["device"]["name"] == here["name"]
    assert f"CPU model: profile {table.meta['device']['name']!r}, here {here['name']!r}" in caplog.text
    assert "this machine's own quick profile" in caplog.text and str(measured_cost_cache) in caplog.text
    assert resolver.source.kind == "measured" and resolver.source.measured_s > 0
    kept = list(measured_cost_cache.glob("quick-*.json"))
    assert len(kept) == 1 and resolver.source.cached == str(kept[0])
    # a later process: nothing measured in it yet, the kept table is loaded, nothing is measured
    forget_measured()
    _forbid_measuring(monkeypatch)
    later = CostTableResolver(target, draft, progress=False)
    assert later.prepare(2).target_ms == measured.target_ms
    assert later.source.measured_s == 0 and "measured by an earlier run on this machine" in later.source.describe()
    # another thread count is another machine: not loaded (it would measure)
    monkeypatch.setattr(torch, "get_num_threads", lambda: here["threads"] + 1)
    with pytest.raises(AssertionError, match="a cost measurement inside decoding"):
        forget_measured()
        CostTableResolver(target, draft, progress=False).prepare(1)


def test_given_profile_of_another_cpu_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    """A profile passed explicitly (cost_profile) from another CPU model is the user's choice:
    used, with a warning naming both values and how to re-profile; nothing is measured."""
    target, draft, table, here, path = _profile_of_another_cpu(tmp_path, "given.json")
    _forbid_measuring(monkeypatch)
    resolver = CostTableResolver(target, draft, str(path), progress=False)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        assert resolver.prepare(2).batch_sizes == [1, 2]
    assert resolver.table is not None and resolver.table.differences(target, draft)[0].blocking is False
    assert f"CPU model: profile {table.meta['device']['name']!r}, here {here['name']!r}" in caplog.text
    assert f"torch threads: profile {here['threads'] + 14}, here {here['threads']}" in caplog.text
    assert "specdec profile" in caplog.text
    assert resolver.source.kind == "file" and "another machine" in resolver.source.describe()
    assert "batch sizes 1, 2)" in resolver.source.describe()  # a loaded profile names the sizes it holds


def test_other_models_without_a_profile_are_measured_without_a_mismatch_warning(caplog):
    """No profile asked for, and models that are not the bundled pair: the shipped profile (the
    bundled pair's) is skipped quietly; the quick measurement is announced, nothing calls it a mismatch."""
    forget_measured()
    target, draft = pair()
    resolver = CostTableResolver(target, draft, None, progress=False)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        resolver.prepare(1)
    assert "measuring a quick cost profile" in caplog.text
    assert "does not fit" not in caplog.text and "shipped" not in caplog.text
    assert resolver.source.kind == "measured"


def test_mismatched_file_is_measured_before_decoding_with_the_reason(tmp_path, caplog):
    forget_measured()
    target, draft = pair()
    table = profile.profile_models(target, draft, profile.ProfileGrid(batch_sizes=(1,), context_step=16, num_contexts=1, n_grid=(1,), warmup=0, repeats=1, min_time_ms=0.0))
    table.meta["dtype"] = "float16"
    path = table.save(tmp_path / "half.json")
    resolver = CostTableResolver(target, draft, str(path), progress=False)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        resolver.prepare(1)
    assert "does not fit these models (dtype: profile 'float16', here 'float32')" in caplog.text
    assert "--dtype float16" in caplog.text and "the shipped profile" not in caplog.text
    assert resolver.source.kind == "measured" and CostTable.load(path).meta["dtype"] == "float16"  # a full profile is never overwritten


def test_shipped_profile_fits_the_bundled_pair_shapes():
    from transformers import AutoConfig

    from specdec.models.loading import BUNDLED_PAIR

    shipped = CostTable.load(SHIPPED_PROFILE)
    for which in ("target", "draft"):
        cfg = AutoConfig.from_pretrained(BUNDLED_PAIR / which)
        assert shipped.meta[which]["shape"]["hidden_size"] == cfg.hidden_size
        assert shipped.meta[which]["shape"]["num_layers"] == cfg.num_hidden_layers


def test_profile_source_describes_itself():
    src = ProfileSource(kind="measured", measured_s=12.34, device="cpu 'x', 2 threads, float32", batch_sizes=[1, 2, 4], path="p.json", saved=True)
    assert src.describe() == "measured before the run (12.3 s; cpu 'x', 2 threads, float32; batch sizes 1, 2, 4; saved to p.json)"
    assert src.to_dict()["text"] == src.describe()


def test_profiles_are_measured_as_decoding_runs_the_forwards(monkeypatch, measured_cost_cache):
    """A quick profile is measured the way decoding runs the forwards: with CUDA graphs where the
    decoder replays them (on a GPU an eager forward waits on its launches and looks flat for more
    tokens than a replayed one costs), eagerly where it does not; the two are cached apart."""
    forget_measured()
    target, draft = pair()
    asked: list[bool] = []
    real = profile.profile_models

    def recording(*args, **kwargs):
        asked.append(kwargs.get("cuda_graphs", False))
        return real(*args, **{**kwargs, "cuda_graphs": False})  # no GPU here: measure eagerly, as if replayed

    monkeypatch.setattr(profile, "profile_models", recording)
    assert CostTableResolver(target, draft, progress=False).prepare(1).meta["cuda_graphs"] is False  # auto on a CPU: eager
    CostTableResolver(target, draft, progress=False, cuda_graphs=True).prepare(1)  # another mode: measured again
    CostTableResolver(target, draft, progress=False, cuda_graphs=False).prepare(1)  # the eager one: reused
    assert asked == [False, True]
    assert len(list(measured_cost_cache.glob("quick-*.json"))) == 2


def test_a_profile_measured_in_another_graph_mode_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    target, draft = pair()
    table = profile.profile_models(target, draft, profile.ProfileGrid(batch_sizes=(1,), context_step=16, num_contexts=1, n_grid=(1, 4), warmup=0, repeats=1, min_time_ms=0.0))
    table.meta["cuda_graphs"] = True  # as `specdec profile` writes it on a GPU with graphs on
    path = table.save(tmp_path / "graphs.json")
    _forbid_measuring(monkeypatch)
    resolver = CostTableResolver(target, draft, str(path), progress=False)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        assert resolver.prepare(1).meta["cuda_graphs"] is True
    assert "measured with CUDA graphs on, and decoding runs with them off" in caplog.text
    assert "specdec profile --cuda-graphs off" in caplog.text and resolver.source.notes


def test_each_timed_forward_waits_for_the_device(monkeypatch):
    """A forward only queues its kernels on a GPU (nothing in the static-shape forward reads a
    device value), so every timed forward is bracketed by a wait for the device: before the
    clock starts and before it stops. Without them a GPU profile times the launches alone."""
    from specdec.models.runner import ModelRunner

    target, _ = pair()
    runner = ModelRunner(target)
    generator = torch.Generator().manual_seed(0)
    runner.fill_random(1, 16, generator)
    events: list[str] = []
    monkeypatch.setattr(profile, "sync_device", lambda device: events.append("sync"))
    forward = runner.forward

    def recorded(*args, **kwargs):
        events.append("forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", recorded)
    profile.measure_forward_ms(runner, 16, 4, warmup=1, repeats=3, generator=generator)
    assert events == ["sync", "forward", "sync"] * 4  # the warm-up forward and three timed ones


def test_a_kept_profile_that_no_longer_matches_this_machine_is_measured_again(caplog, measured_cost_cache):
    """A quick profile kept in the machine's cache is spot-checked when a process loads it (one-token
    target forwards at each batch size it holds): one whose costs are 20x what this machine takes now
    (as one measured while something else loaded the machine) is measured again and kept anew."""
    forget_measured()
    target, draft = pair()
    first = CostTableResolver(target, draft, progress=False)
    measured = first.prepare(2)
    kept = list(measured_cost_cache.glob("quick-*.json"))
    assert len(kept) == 1
    inflated = CostTable.load(kept[0])
    inflated.target_ms = {b: [[20.0 * x for x in row] for row in rows] for b, rows in inflated.target_ms.items()}
    inflated.save(kept[0])
    forget_measured()  # a later process
    later = CostTableResolver(target, draft, progress=False)
    with caplog.at_level(logging.WARNING, logger="specdec.cost"):
        table = later.prepare(2)
    assert "no longer matches this machine" in caplog.text and "B = 1: kept" in caplog.text
    assert later.source.measured_s > 0 and "measured again" in later.source.describe()
    assert table.target_cost(1, 256, 1) < 5.0 * measured.target_cost(1, 256, 1)  # the new measurement, not the inflated one
    assert CostTable.load(kept[0]).target_ms == table.target_ms  # kept anew


@pytest.mark.parametrize(("now_ms", "stale"), [(10.0, False), (14.0, False), (7.0, False), (16.0, True), (6.0, True)])
def test_stale_points_tolerance(monkeypatch, now_ms, stale):
    """A kept cost within STALE_RATIO (1.5x) either way of the one measured now passes."""
    target, _ = pair()
    table = CostTable.synthetic(lambda b, c, n: 10.0, lambda b, c, n: 1.0, batch_sizes=(1,))
    monkeypatch.setattr(profile, "measure_forward_ms", lambda *args, **kwargs: now_ms)
    points = profile.stale_points(table, target)
    assert bool(points) == stale
    if stale:
        assert points == [(1, pytest.approx(10.0), now_ms)]



# ----- `specdec profile`: flags named, memory ------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [("--contexts", "0", "--contexts=0 must be a positive integer"), ("--context-step", "-8", "--context-step=-8 must be"),
     ("--warmup", "-1", "--warmup=-1 must be an integer >= 0"), ("--repeats", "0", "--repeats=0 must be a positive integer")],
)
def test_profile_grid_errors_name_the_flag(tmp_path, capsys, monkeypatch, flag, value, needle):
    import specdec.models.loading

    monkeypatch.setattr(specdec.models.loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the bad value was reported"))
    assert main(["profile", flag, value, "--out", str(tmp_path / "p.json")]) == 2
    assert needle in capsys.readouterr().err


def test_profile_n_grid_in_any_order_and_out_of_memory(tiny_pair_dir, tmp_path, capsys, monkeypatch):
    import specdec.cost.profile

    grids = []

    def out_of_memory(target, draft, grid, **kwargs):
        grids.append(grid)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1835008000000 bytes")

    monkeypatch.setattr(specdec.cost.profile, "profile_models", out_of_memory)
    args = ["profile", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--device", "cpu",
            "--batch-sizes", "1,100000", "--contexts", "1", "--context-step", "8", "--n-grid", "4,1,2", "--out", str(tmp_path / "p.json")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert grids[0].n_grid == (1, 2, 4)
    assert "ran out of memory" in err and "batch size 100000" in err and "smaller --batch-sizes" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


# ----- malformed tables: a SpecDecError naming the problem --------------------------------------


def test_load_refuses_files_that_are_not_a_profile_object(tmp_path):
    """JSON that is not an object, bytes that are not UTF-8 and tables of the wrong shape had
    raised AttributeError or UnicodeDecodeError from inside the loader."""
    good = CostTable.synthetic(lambda b, c, n: 1.0 + n, lambda b, c, n: 0.5, batch_sizes=(1, 2), num_contexts=2, n_grid=(1, 2, 4)).to_json()
    cases = {
        "list.json": json.dumps([1, 2]),
        "null.json": "null",
        "targets.json": json.dumps({**good, "target_ms": [[1.0]]}),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SpecDecError, match="re-run `specdec profile`|create one with `specdec profile`"):
            CostTable.load(tmp_path / name)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(SpecDecError, match="is not readable JSON"):
        CostTable.load(tmp_path / "binary.json")
    zero = {**good, "target_ms": {**good["target_ms"], "0": good["target_ms"]["1"]}, "draft_ms": {**good["draft_ms"], "0": good["draft_ms"]["1"]}}
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    with pytest.raises(SpecDecError, match="cost table batch size 0 must be a positive integer"):
        CostTable.load(tmp_path / "zero.json")
    with pytest.raises(SpecDecError, match="must be a file path"):
        CostTable.load(None)


def test_synthetic_names_a_bad_cost_function_or_grid():
    flat = lambda b, c, n: 1.0  # noqa: E731
    with pytest.raises(SpecDecError, match=r"CostTable.synthetic target\(1, 256, 1\) returned None, not a number of milliseconds"):
        CostTable.synthetic(lambda b, c, n: None, flat)
    with pytest.raises(SpecDecError, match="draft=2.0 must be a function f"):
        CostTable.synthetic(flat, 2.0)
    with pytest.raises(SpecDecError, match="batch_sizes=4 must be a list of integers"):
        CostTable.synthetic(flat, flat, batch_sizes=4)
    with pytest.raises(SpecDecError, match=r"n grid \[1.5, 3\] must be a list of integers"):  # costs measured at 1.5 had been filed under n = 1
        CostTable.synthetic(flat, flat, n_grid=[1.5, 3])
