"""`specdec sweep`: the DynaTree grid (depth x branching x pruning threshold) on the tiny pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli_args

from specdec.bench.sweep import (
    GridPoint,
    SweepConfig,
    estimate_tokens,
    grid_points,
    grid_variants,
    heatmap_name,
    parse_float_list,
)
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.parsing import parse_int_list

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sweep_args(pair: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return cli_args("sweep", pair, prompts, out, 8, 1, "--num-prompts", "1", *extra)


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "add.py", "prompt": "def add(a, b):\n"}) + "\n", encoding="utf-8")
    return path


def test_grid_and_lists():
    config = SweepConfig(prompts="x", out="y")
    points = grid_points(config)
    assert len(points) == 6 * 3 * 5 == 90  # the paper's grid by default
    assert points[0] == GridPoint(3, 2, 0.01) and points[-1] == GridPoint(8, 4, 0.1)
    variants = grid_variants(config)
    assert variants[0].label == "ar" and len(variants) == 91
    opts = dict(variants[-1].options)
    assert opts["phase"] == 0 and opts["d0"] == 8 and opts["b_mid"] == 4 and opts["prune_tau"] == 0.1 and opts["max_nodes"] == 256
    policy = make_policy("dynatree", **opts)
    assert policy.b_mid == 4 and policy.b_max >= 4  # b_max is raised so B=4 is a valid bound
    assert GridPoint(9, 2, 0.03).options(0, 256)["d_max"] == 9  # d_max follows a deeper D
    assert parse_int_list("3, 4,4,5", "--depths") == [3, 4, 5] and parse_float_list("0.01,0", "--taus") == [0.01, 0.0]
    for text, flag, needle in (("0", "--depths", "must be a positive integer"), ("x", "--depths", "not an integer"), ("", "--depths", "is empty")):
        with pytest.raises(SpecDecError, match=needle):
            parse_int_list(text, flag)
    with pytest.raises(SpecDecError, match=r"must be in \[0, 1\)"):
        parse_float_list("1.5", "--taus")
    assert estimate_tokens(90, 3, 2, 128) == 91 * 3 * 2 * 128
    assert heatmap_name(0.03) == "heatmap_tau_0.03.png"


def test_bench_configs_share_one_declaration_of_their_common_fields():
    """bench, bench-serve and sweep declare the prompts/pair fields once (and bench/sweep the
    measurement fields once); the sweep's inner BenchConfig carries every one of them, and
    the CLI fills the pair fields from one helper."""
    import argparse
    import dataclasses

    from specdec.bench.config import MeasuredRunConfig, PairRunConfig
    from specdec.bench.runner import BenchConfig
    from specdec.bench.serving import ServeBenchConfig
    from specdec.bench.sweep import bench_config
    from specdec.cli import add_model_args, pair_fields

    assert issubclass(BenchConfig, MeasuredRunConfig) and issubclass(SweepConfig, MeasuredRunConfig)
    assert issubclass(ServeBenchConfig, PairRunConfig) and issubclass(MeasuredRunConfig, PairRunConfig)
    config = SweepConfig(
        prompts="p", out="o", num_prompts=5, target="t", draft="d", device="cpu", dtype="float32",
        load_options={"revision": "r"}, max_new_tokens=9, repeats=4, seed=7, progress=False,
    )
    inner = bench_config(config)
    for f in dataclasses.fields(MeasuredRunConfig):
        assert getattr(inner, f.name) == getattr(config, f.name), f.name
    assert inner.load_options is not config.load_options
    assert inner.methods == ["ar"] and inner.verify == ["greedy"] and inner.batch_size == 1
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    pair = pair_fields(parser.parse_args(["--target", "t", "--device", "cpu"]))
    assert set(pair) | {"prompts", "out", "num_prompts"} == {f.name for f in dataclasses.fields(PairRunConfig)}
    assert pair["target"] == "t" and pair["device"] == "cpu" and pair["load_options"]["trust_remote_code"] is False


def test_sweep_end_to_end(tiny_pair_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = _sweep_args(tiny_pair_dir, _prompts(tmp_path), out, "--depths", "2,3", "--branchings", "2", "--taus", "0.01,0.1")
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "4 configs + AR" in captured.err and "best: D=" in captured.out
    data = json.loads((out / "sweep.json").read_text())
    assert [(r["depth"], r["branching"], r["tau"]) for r in data["rows"]] == [(2, 2, 0.01), (2, 2, 0.1), (3, 2, 0.01), (3, 2, 0.1)]
    for row in data["rows"]:
        assert row["speedup"] > 0 and row["tokens_per_s_median"] > 0 and row["matches_ar"] is True  # greedy: lossless
        assert row["options"]["phase"] == 0 and row["options"]["d0"] == row["depth"] and row["options"]["prune_tau"] == row["tau"]
        assert row["tau_tokens_per_step"] >= 1.0
    assert data["ar"]["tokens_per_s_median"] > 0 and data["best"]["speedup"] == max(r["speedup"] for r in data["rows"])
    assert data["heatmaps"] == ["heatmap_tau_0.01.png", "heatmap_tau_0.1.png"]
    for name in data["heatmaps"]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    table = (out / "sweep.md").read_text()
    assert "## Every configuration" in table and "| 3 | 2 | 0.1 |" in table and "**Best**" in table and "specdec sweep" in table


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--depths", "0"], "--depths: 0 must be a positive integer"),
        (["--taus", "0.01,2"], "--taus: 2.0 must be in [0, 1)"),
        (["--branchings", "2,x"], "--branchings: 'x' is not an integer"),
        (["--phase", "5"], "--phase 5 must be 0, 1, 2 or 3"),
    ],
)
def test_sweep_errors_exit_2(tiny_pair_dir, tmp_path, capsys, extra, needle):
    assert main(_sweep_args(tiny_pair_dir, _prompts(tmp_path), tmp_path / "out", *extra)) == 2
    assert needle in capsys.readouterr().err


def test_sweep_bad_phase_is_refused_before_the_plan(tiny_pair_dir, tmp_path, capsys):
    """--phase is checked before the plan (and its time estimate) is printed: the error is the only line."""
    assert main(_sweep_args(tiny_pair_dir, _prompts(tmp_path), tmp_path / "out", "--phase", "9")) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["specdec: error: --phase 9 must be 0, 1, 2 or 3 (0: the fixed tree; 1-3 add the adaptive rules)"], err
    assert not (tmp_path / "out").exists()
