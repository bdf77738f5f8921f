"""`specdec bench`: prompt loading, the end-to-end run via the CLI, and its error paths."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest
from conftest import cli_args

from specdec.bench import prompts as prompts_mod
from specdec.bench.prompts import STDLIB_HELDOUT, load_prompts, resolve_prompt_source
from specdec.bench.runner import make_variants, parse_methods, parse_verify
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.stats import GenerationStats, batch_stats, upper_bound_speedup

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LINES = [
    {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "canonical_solution": "    return a + b\n"},
    {"question_id": 81, "turns": ["for i in range(10):\n", "class A:\n"]},
    {"id": "img", "prompt": "class A:\n", "images": ["a.png"], "reference": "    pass\n"},
]


def _write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ----- prompt sets ---------------------------------------------------------------------


def test_load_prompts_prompt_turns_and_fields(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG_MAGIC)
    path = _write_jsonl(tmp_path / "p.jsonl", [LINES[0], "", LINES[1], LINES[2]])
    items = load_prompts(path)
    assert [p.id for p in items] == ["HumanEval/0", "81", "img"]
    assert items[0].turns == ["def add(a, b):\n"] and items[0].reference == "    return a + b\n"
    assert items[1].turns == ["for i in range(10):\n", "class A:\n"] and items[1].reference is None
    assert items[2].images == [tmp_path / "a.png"] and items[2].reference == "    pass\n"
    assert [p.id for p in load_prompts(path, limit=2)] == ["HumanEval/0", "img"]  # spread over the file: indices 0 and 2


def test_load_prompts_gzip(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG_MAGIC)
    path = _write_jsonl(tmp_path / "p.jsonl.gz", LINES, gz=True)
    assert [p.turns for p in load_prompts(path)] == [p.turns for p in load_prompts(_write_jsonl(tmp_path / "q.jsonl", LINES))]


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([LINES[0], "{not json"], "p.jsonl:2"),
        ([LINES[0], {"text": "x"}], "p.jsonl:2: the line has neither"),
        ([{"turns": []}], "p.jsonl:1: 'turns' must be"),
        ([{"prompt": 3}], "p.jsonl:1: 'prompt' must be"),
        ([[1, 2]], "p.jsonl:1: expected a JSON object"),
        ([""], "has no prompts"),
    ],
)
def test_bad_prompt_file_names_file_and_line(tmp_path, rows, needle):
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(SpecDecError) as info:
        load_prompts(path)
    assert needle in str(info.value)


def test_resolve_prompt_source(tmp_path, monkeypatch):
    with pytest.raises(SpecDecError, match="no such file"):
        resolve_prompt_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(SpecDecError, match="a directory; pass"):
        resolve_prompt_source(str(tmp_path))
    monkeypatch.setattr(prompts_mod, "BUNDLED_PAIR", tmp_path)
    with pytest.raises(SpecDecError, match="bundled prompt set 'stdlib-heldout' is missing"):
        resolve_prompt_source(STDLIB_HELDOUT)
    path = _write_jsonl(tmp_path / "stdlib-heldout.jsonl", LINES[:1])
    assert resolve_prompt_source(STDLIB_HELDOUT) == path


# ----- configuration and metrics ------------------------------------------------------


def test_methods_verify_and_variants():
    assert parse_methods("chain,hf,chain") == ["ar", "chain", "hf"]
    with pytest.raises(SpecDecError, match="'nope' is not known"):
        parse_methods("ar,nope")
    assert parse_verify("auto", 0.0) == ["greedy"] and parse_verify("auto", 0.7) == ["sampling"]
    with pytest.raises(SpecDecError, match="temperature"):
        parse_verify("greedy", 0.7)
    labels = [v.label for v in make_variants(["ar", "chain", "hf"], ["greedy", "sampling"], 0.0)]
    assert labels == ["ar", "chain/greedy", "chain/sampling", "hf"]


def test_upper_bound_and_batch_stats():
    assert upper_bound_speedup(5.0, 0.01, 0.02, 0.01) == pytest.approx(5 * 0.01 / 0.03)
    assert upper_bound_speedup(5.0, 0.01, 0.0, 0.0) == 0.0
    a = GenerationStats(
        new_tokens=10,
        wall_s=2.0,
        ttft_s=0.5,
        draft_s=0.4,
        verify_s=0.6,
        accepted_lens=[1, 2],
        drafted_by_depth=[2, 2],
        accepted_by_depth=[2, 1],
    )
    b = GenerationStats(
        new_tokens=6, wall_s=2.0, ttft_s=0.5, draft_s=0.3, verify_s=0.5, accepted_lens=[0], drafted_by_depth=[2], accepted_by_depth=[0]
    )
    a.root_only_steps, b.root_only_steps = 1, 1
    merged = batch_stats([a, b])
    assert merged.root_only_steps == 2  # per row-step, like accepted_lens
    assert merged.tokens_per_s == 8.0 and merged.draft_s == 0.4 and merged.verify_s == 0.6
    assert merged.accepted_lens == [1, 2, 0] and merged.drafted_by_depth == [4, 2] and merged.accepted_by_depth == [2, 1]
    timed = batch_stats([a, b], wall_s=4.0)
    assert timed.tokens_per_s == 4.0 and timed.ttft_s == 0.5
    assert batch_stats([a]).tokens_per_s == a.tokens_per_s and batch_stats([a]).tau == a.tau


def test_batch_stats_of_a_rolling_call_count_every_step():
    """Given the call's step records, steps and the drafting and verification time are summed over
    them: in a rolling call no row saw every step, so the longest any row saw is short of the call's."""
    from specdec.stats import StepRecord

    def record(step: int, draft_s: float, verify_s: float, admit_s: float = 0.0) -> StepRecord:
        return StepRecord(step, [True], [1], [0], [1], [0], [0], 1, draft_s, verify_s, [[1]], [0], admit_s=admit_s)

    # two prompts, one after the other in one row: 2 steps and one prefill each
    a = GenerationStats(new_tokens=2, wall_s=1.0, prefill_s=0.05, draft_s=0.2, verify_s=0.4, steps=2, accepted_lens=[0, 0])
    b = GenerationStats(new_tokens=2, wall_s=1.0, prefill_s=0.07, draft_s=0.3, verify_s=0.5, steps=2, accepted_lens=[0, 0])
    steps = [record(0, 0.1, 0.2, 0.05), record(1, 0.1, 0.2), record(2, 0.1, 0.25, 0.07), record(3, 0.2, 0.25)]
    merged = batch_stats([a, b], wall_s=2.0, steps=steps)
    assert merged.steps == 4 and merged.draft_s == pytest.approx(0.5) and merged.verify_s == pytest.approx(0.9)
    assert merged.prefill_s == pytest.approx(0.12)  # both admissions
    rows_only = batch_stats([a, b], wall_s=2.0)
    assert rows_only.steps == 2 and rows_only.draft_s == 0.3 and rows_only.prefill_s == 0.07  # what a static batch's longest-lived row saw


def test_step_records_carry_every_admission_once(tiny_pair_dir):
    """A rolling call's step records hold each admission's time once: summed, they give the
    call's prefill time, the sum of the distinct admissions the rows saw (rows admitted together
    share one), and a static call's equals its one prefill."""
    from specdec.api import SpeculativeDecoder
    from specdec.sampling import SamplingParams

    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="chain", device="cpu")
    prompts = [decoder.encode(t) for t in ("def add(a, b):\n", "x = 1\n", "import os\n", "class A:\n", "while True:\n")]
    for batch_size in (2, 5):
        outs = decoder.generate_ids(prompts, 6, SamplingParams(), keep_steps=True, batch_size=batch_size)
        steps = outs[0].steps
        admissions = {o.stats.prefill_s for o in outs}  # rows admitted together saw the same prefill
        assert sum(s.admit_s for s in steps) == pytest.approx(sum(admissions))
        assert batch_stats([o.stats for o in outs], steps=steps).prefill_s == pytest.approx(sum(admissions))
        admitting = [s.step for s in steps if s.admit_s > 0]
        if batch_size == 5:  # one batch: one prefill, before the first step
            assert admitting == [0] and len(admissions) == 1
        else:  # two rows over five prompts: the first two together, then as rows come free
            assert admitting[0] == 0 and len(admitting) == len(admissions) >= 3


def test_turn_context_and_fit(tiny_pair_dir):
    from transformers import AutoTokenizer

    from specdec.bench.prompts import BenchPrompt
    from specdec.bench.runner import TURN_SEPARATOR, fit_context, turn_context

    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    conv = BenchPrompt(id="c", turns=["def add(a, b):\n", "class A:\n"])
    first = turn_context(tok, conv, 0, None, [], [tok.eos_token_id])
    assert first == tok(conv.turns[0])["input_ids"]
    answer = [5, 6, tok.eos_token_id]
    second = turn_context(tok, conv, 1, first, [answer], [tok.eos_token_id])
    tail = tok(TURN_SEPARATOR + conv.turns[1], add_special_tokens=False)["input_ids"]
    assert second == first + [5, 6] + tail  # the answer's EOS is dropped
    assert fit_context(list(range(10)), 12, 4) == (list(range(2, 10)), True)
    assert fit_context(list(range(10)), None, 4) == (list(range(10)), False)
    with pytest.raises(SpecDecError, match="leaves no room"):
        fit_context([1], 8, 8)


# ----- the CLI, end to end ---------------------------------------------------------------


def _bench_args(pair: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return cli_args("bench", pair, prompts, out, 10, 2, *extra)


def test_bench_end_to_end_greedy(tiny_pair_dir, tmp_path, capsys):
    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:2])
    out = tmp_path / "out"
    methods = "ar,hf,hf-assisted,hf-lookup,chain,static,eagle2"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", methods, "--depth", "3")) == 0
    for name in ("report.md", "results.json", "speedup.png", "tau_distribution.png", "acceptance_by_depth.png"):
        assert (out / name).is_file(), name
    for name in ("speedup.png", "tau_distribution.png", "acceptance_by_depth.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == methods.split(",")
    assert results["methods"]["ar"]["speedup"] == 1.0
    for label, summary in results["methods"].items():
        assert summary["matches_ar"] is True, label
        assert summary["equality_mismatches"] == 0 and summary["equality_compared"] == 3 * 2, label  # 3 turns x 2 repeats
        assert summary["tokens_per_s_median"] > 0
    assert results["methods"]["chain"]["tau"] >= 1.0 and results["methods"]["hf"]["tau"] is None
    assert results["methods"]["static"]["upper_bound_speedup"] > 0
    assert results["config"]["method_options"]["static"] == {"depth": 3} and results["config"]["method_options"]["eagle2"] == {"depth": 3}
    # interleaved, repeated: every method ran every (prompt, turn) in both repeats
    assert len(results["records"]) == len(methods.split(",")) * 3 * 2
    assert {(r["group"], r["turn"]) for r in results["records"]} == {(0, 0), (1, 0), (1, 1)}
    # every row's first divergence from AR's output (none in float32), written for a reader to check the margins
    assert all(r["divergences"] == [None] * len(r["outputs"]) for r in results["records"] if r["label"] != "ar")
    report = (out / "report.md").read_text()
    assert "specdec bench --prompts" in report and "transformers" in report and "## Verdict" in report
    assert "The fastest method is" in report or "No method beat AR" in report
    assert "speedup" in capsys.readouterr().out
    # 6 timed calls per method (3 prompt turns x 2 repeats): enough, no warning about unsteady medians
    assert not any("timed call(s) per method" in n for n in results["notes"])
    # root-only steps: every AR step; a drafting method's share is noted when it is 5% or more
    assert results["methods"]["ar"]["root_only_share"] == 1.0
    for label in methods.split(",")[4:]:
        share = results["methods"][label]["root_only_share"]
        rows = [r["stats"] for r in results["records"] if r["label"] == label]
        assert share == pytest.approx(sum(st["root_only_steps"] for st in rows) / sum(len(st["accepted_lens"]) for st in rows))
        assert 0 <= share < 1, label
        noted = any(n.startswith(f"{label}: ") and "verified the root alone" in n for n in results["notes"])
        assert noted == (share >= 0.05), (label, share)


@pytest.mark.parametrize(("lines", "repeats", "calls"), [(LINES[:1], 2, 2), (LINES[1:2], 2, 4), (LINES[:1] * 5, 1, 5)])
def test_bench_notes_unsteady_medians_only_with_few_calls(tiny_pair_dir, tmp_path, lines, repeats, calls):
    """The note counts the timed calls that ran (one per prompt turn per repeat) and appears below 5."""
    prompts = _write_jsonl(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "ar", "--repeats", str(repeats), "--num-prompts", str(len(lines)))) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["records"]) == calls
    warned = any(f"only {calls} timed call(s) per method" in n for n in results["notes"])
    assert warned == (calls < 5)


def test_bench_lookup_draft_source(tiny_pair_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    out = tmp_path / "out"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "ar,chain", "--draft-source", "lookup", "--repeats", "1")) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["draft_source"] == "lookup"
    assert results["methods"]["chain"]["matches_ar"] is True


def test_bench_notes_cuda_graphs_captured_inside_timed_calls(tiny_pair_dir, tmp_path, monkeypatch):
    """A capture inside a timed call counts its time against the method: each call record carries
    its steps' captures and the report names the methods. Emulated by an engine whose capture count
    grows at every read (no GPU here: a CPU run captures nothing and notes nothing)."""
    from specdec.engine import SpeculativeEngine

    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    out = tmp_path / "quiet"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "ar,chain", "--repeats", "1")) == 0
    results = json.loads((out / "results.json").read_text())
    assert not any("CUDA graphs were captured" in n for n in results["notes"]) and all(r["graph_captures"] == 0 for r in results["records"])
    counter = iter(range(10**9))
    monkeypatch.setattr(SpeculativeEngine, "graph_captures", lambda self: next(counter))
    out = tmp_path / "capturing"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "ar,chain", "--repeats", "1")) == 0
    results = json.loads((out / "results.json").read_text())
    note = next(n for n in results["notes"] if "CUDA graphs were captured inside timed calls" in n)
    assert "ar " in note and "chain " in note
    assert all(r["graph_captures"] > 0 for r in results["records"] if r["label"] in ("ar", "chain"))


def test_bench_reports_what_adaptive_methods_learned(tiny_pair_dir, tmp_path):
    """dynatree's and cast's learned state after the timed calls: in results.json and a report section.
    CAST runs its threshold rules at 0 (every top-k node kept): its default break-even rules may, on
    a slow machine's measured costs, plan root-only trees, which verify nothing to calibrate on (a
    CI run did)."""
    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    out = tmp_path / "out"
    thresholds = ("--prune-rule", "threshold", "--rerank-rule", "threshold", "--cast-c1", "0", "--cast-c2", "0", "--cast-c3", "0")
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "ar,chain,dynatree,cast", "--repeats", "1", *thresholds)) == 0
    methods = json.loads((out / "results.json").read_text())["methods"]
    assert methods["ar"]["policy_state"] is None and methods["chain"]["policy_state"] is None
    dyn, cast = methods["dynatree"]["policy_state"], methods["cast"]["policy_state"]
    assert {"d0", "tau_high", "rho_deep", "adjustments"} <= set(dyn) and dyn["calibration"]["top-k"]["observations"] > 0
    assert cast["plain_vs_drafted"] and cast["calibration"]["observations"] > 0
    report = (out / "report.md").read_text()
    section = report.split("## Adaptive state after the timed calls")[1].split("##")[0]
    assert f"- dynatree: D_0 {dyn['d0']}, tau_h" in section and "- cast: B~1: drafted" in section


def test_bench_batch_sizes_sweep(tiny_pair_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:1] * 4)
    out = tmp_path / "out"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "ar,chain", "--batch-sizes", "1,2", "--repeats", "1", "--num-prompts", "2")) == 0
    sweep = json.loads((out / "batch_sweep.json").read_text())
    assert sweep["batch_sizes"] == [1, 2] and set(sweep["methods"]) == {"ar", "chain"}
    assert sweep["methods"]["ar"]["2"]["speedup"] == 1.0
    assert (out / "batch-2" / "report.md").is_file() and (out / "speedup_vs_batch.png").read_bytes()[:8] == PNG_MAGIC
    assert "| chain |" in (out / "batch_sweep.md").read_text()
    assert "`--max-draft-rows` from this sweep" in (out / "batch_sweep.md").read_text()


def test_draft_row_limits_are_the_first_run_of_sizes_at_or_above_ar():
    from types import SimpleNamespace

    from specdec.bench.batch_sweep import draft_row_limits

    def row(*speedups, peer=False):
        return {b: SimpleNamespace(speedup=x, peer=peer) for b, x in zip([1, 2, 4, 8], speedups, strict=False)}

    table = {
        "ar": row(1.0, 1.0, 1.0, 1.0),
        "chain": row(1.3, 1.1, 0.9, 1.05),  # ahead again at 8 after falling behind at 4: the limit stays 2
        "eagle2": row(0.95, 1.2, 1.2, 1.2),
        "cast": row(1.2, 1.1, 1.0, 1.01),
        "hf-assisted": row(1.4, peer=True),
    }
    assert draft_row_limits(table, [1, 2, 4, 8]) == {"chain": 2, "eagle2": None, "cast": 8}


def test_bench_batched_sampling_skips_single_row_peers(tiny_pair_dir, tmp_path, capsys):
    """A skipped peer is noted in the report and on stderr (it vanished from the console table
    without a word), and so is a prompt file shorter than --num-prompts."""
    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:2])
    out = tmp_path / "out"
    args = _bench_args(tiny_pair_dir, prompts, out, "--methods", "hf-assisted,chain", "--batch-size", "2", "--temperature", "0.8", "--seed", "3")
    args += ["--num-prompts", "5"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "specdec: note: Hugging Face peers (hf-assisted) run only at batch size 1" in err
    assert f"specdec: note: {prompts} holds 2 prompt(s), fewer than --num-prompts 5: all 2 ran." in err
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ar", "chain"]
    assert any("hf-assisted" in n and "batch size 1" in n for n in results["notes"])
    assert results["methods"]["chain"]["verify"] == "sampling" and results["methods"]["chain"]["matches_ar"] is None
    assert "n/a" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--methods", "ar,warp"], "'warp' is not known"),
        (["--methods", "ar,chain", "--branching", "2"], "--branching applies to none"),
        (["--repeats", "0"], "--repeats=0 must be a positive integer"),
        (["--verify", "fuzzy"], "'fuzzy' is not a known accept rule"),
    ],
)
def test_bench_errors_exit_2(tiny_pair_dir, tmp_path, capsys, extra, needle):
    prompts = _write_jsonl(tmp_path / "p.jsonl", LINES[:1])
    assert main(_bench_args(tiny_pair_dir, prompts, tmp_path / "out", *extra)) == 2
    assert needle in capsys.readouterr().err


def test_bench_bad_prompt_file_exit_2(tiny_pair_dir, tmp_path, capsys):
    prompts = _write_jsonl(tmp_path / "p.jsonl", [LINES[0], "{oops"])
    assert main(_bench_args(tiny_pair_dir, prompts, tmp_path / "out")) == 2
    assert "p.jsonl:2" in capsys.readouterr().err


def test_host_work_count_skips_prompts_that_end_at_once():
    """The ops/reads per step come from as many prompt groups as it takes to see 16 decoding steps:
    a first prompt whose first token is EOS (no step) must not make the count that of set-up alone."""
    from types import SimpleNamespace

    import torch

    from specdec.bench.prompts import BenchPrompt
    from specdec.bench.runner import HOST_WORK_MIN_STEPS, _Runner

    steps_per_group = [0, 10, 10, 10]  # group 0: EOS at once
    calls: list[int] = []

    def generate_ids(contexts, max_new_tokens, params, verify=None, seed=None):
        steps = steps_per_group[len(calls)]
        calls.append(steps)
        x = torch.zeros(4)
        for _ in range(3):  # set-up: 3 ops whatever the prompt
            x = x + 1
        for _ in range(steps):  # 5 ops and 1 host read per decoding step
            for _ in range(5):
                x = x * 1.5
            x.sum().item()
        return [SimpleNamespace(stats=SimpleNamespace(steps=steps)) for _ in contexts]

    stub = SimpleNamespace(
        context=lambda prompt, turn, previous, answers, max_new: ([1, 2, 3], False),
        config=SimpleNamespace(max_new_tokens=8),
        decoders={"chain": SimpleNamespace(generate_ids=generate_ids)},
        params=None,
        seed=lambda repeat, group, turn: 0,
    )
    groups = [[BenchPrompt(id=str(i), turns=["x"])] for i in range(len(steps_per_group))]
    work = _Runner.count_host_work(stub, SimpleNamespace(label="chain", verify="greedy"), groups)  # type: ignore[arg-type]
    assert calls == [0, 10, 10]  # stops once 20 >= 16 steps were seen; group 3 never runs
    assert work["steps"] == 20.0 >= HOST_WORK_MIN_STEPS
    assert work["host_reads"] == 1.0  # the sum's .item(), once per step
    assert work["host_bytes"] == 4.0  # a float32 scalar
    assert 5.0 <= work["ops"] <= 7.0  # 5 multiplies + the sum per step, set-up (3 x 3 adds) spread over 20 steps


def test_bench_batched_hf_generate_equals_batched_ar(tiny_pair_dir, tmp_path):
    """At --batch-size 2 `hf` runs as one left-padded generate() per group; greedy, its rows equal AR's."""
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def add(a, b):\n"}, {"prompt": "for i in range(10):\n    print(i)\nclass A:\n"}, {"prompt": "x = 1\n"}])
    out = tmp_path / "out"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", "hf,hf-lookup,chain", "--batch-size", "2", "--repeats", "1", "--num-prompts", "3")) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ar", "hf", "chain"]
    assert results["methods"]["hf"]["matches_ar"] is True and results["methods"]["hf"]["equality_compared"] == 3
    assert {len(r["outputs"]) for r in results["records"] if r["label"] == "hf"} == {2, 1}  # a batch of 2, then the last prompt
    assert any("hf-lookup" in n and "hf runs as one left-padded batched generate() call" in n for n in results["notes"])


def test_bench_rolling_schedule_decodes_every_prompt_through_one_rolling_batch(tiny_pair_dir, tmp_path, monkeypatch):
    """--schedule rolling: one timed call per repeat over every prompt, the engine's batch capped at
    --batch-size rows (a finished row's place goes to the next prompt); greedy outputs still equal
    AR's; HF's generate() runs the groups back to back inside the call, its wall time their sum."""
    from specdec.api import SpeculativeDecoder
    from specdec.bench import runner as runner_mod

    texts = ["def add(a, b):\n", "for i in range(10):\n    print(i)\nclass A:\n", "x = 1\n", "import os\n", "while True:\n"]
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": t} for t in texts])
    calls: list[tuple[int, int | None]] = []
    generate_ids = SpeculativeDecoder.generate_ids

    def spy(self, prompt_ids, *args, **kwargs):
        calls.append((len(prompt_ids), kwargs.get("batch_size")))
        return generate_ids(self, prompt_ids, *args, **kwargs)

    peer_batches: list[int] = []
    run_peer_batch = runner_mod.run_peer_batch

    def peer_spy(name, target, contexts, *args):
        peer_batches.append(len(contexts))
        return run_peer_batch(name, target, contexts, *args)

    monkeypatch.setattr(SpeculativeDecoder, "generate_ids", spy)
    monkeypatch.setattr(runner_mod, "run_peer_batch", peer_spy)
    out = tmp_path / "out"
    args = _bench_args(tiny_pair_dir, prompts, out, "--methods", "hf,chain,eagle2", "--batch-size", "2", "--schedule", "rolling", "--num-prompts", "5")
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["schedule"] == "rolling"
    for label in ("ar", "hf", "chain", "eagle2"):
        records = [r for r in results["records"] if r["label"] == label]
        assert len(records) == 2 and all(len(r["outputs"]) == 5 for r in records), label  # one call per repeat, every prompt
        assert results["methods"][label]["matches_ar"] is True and results["methods"][label]["equality_compared"] == 10, label
    assert (5, 2) in calls  # the timed calls: five prompts through two rows
    assert set(peer_batches) == {2}  # hf: groups of 2, then the last prompt alone (one-row generate())
    for r in results["records"]:
        if r["stats"] is not None:  # the call's steps, not the most any one row saw
            assert r["stats"]["steps"] == len(r["step_draft_s"]), r["label"]
    # TTFT and TPOT per request: every prompt's own, medians over every row of every call
    for label in ("ar", "chain", "eagle2"):
        records = [r for r in results["records"] if r["label"] == label]
        ttft = [x for r in records for x in r["row_ttft_s"]]
        tpot = [x for r in records for x in r["row_tpot_s"]]
        assert len(ttft) == 10 and len(tpot) >= 2, label
        # prompts that waited for a free row start later than the first two, which start together
        assert max(r["row_ttft_s"][-1] for r in records) > max(max(r["row_ttft_s"][:2]) for r in records), label
        assert results["methods"][label]["ttft_ms"] == pytest.approx(statistics.median(ttft) * 1e3), label
        assert results["methods"][label]["tpot_ms"] == pytest.approx(statistics.median(tpot) * 1e3), label
        call_tpot = [r["stats"]["wall_s"] / r["stats"]["new_tokens"] for r in records]  # the batch's aggregate time per token
        assert statistics.median(tpot) > statistics.median(call_tpot), label  # one stream's is slower than two rows' together
    assert "rolling batch" in (out / "report.md").read_text()


def test_bench_schedule_must_be_known():
    from specdec.bench.runner import BenchConfig, validate_config

    with pytest.raises(SpecDecError, match="--schedule 'round-robin': choose one of groups, rolling"):
        validate_config(BenchConfig(prompts="stdlib-heldout", out="x", schedule="round-robin"))


def test_root_only_notes_name_the_methods_that_often_draft_nothing():
    """A drafting method whose row-steps verified the root alone 5% of the time or more gets a note
    (its τ averages those one-token steps in); AR, peers and methods below the share get none."""
    from types import SimpleNamespace

    from specdec.bench.report import root_only_notes

    summaries = [
        SimpleNamespace(label="ar", method="ar", peer=False, root_only_share=1.0),
        SimpleNamespace(label="hf", method="hf", peer=True, root_only_share=None),
        SimpleNamespace(label="chain", method="chain", peer=False, root_only_share=0.02),
        SimpleNamespace(label="cast", method="cast", peer=False, root_only_share=0.62),
    ]
    notes = root_only_notes(summaries)
    assert len(notes) == 1 and notes[0].startswith("cast: 62% of its steps (per row) verified the root alone")
