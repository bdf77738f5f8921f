"""`specdec bench` method variants (`--methods` items with options), quality metrics and the MARS θ sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import cli_args

from specdec.bench.prompts import BenchPrompt
from specdec.bench.quality import completion_logprobs, is_code_prompt
from specdec.bench.variants import make_variants, parse_method_specs, parse_thetas, split_method_list
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.stats import (
    code_parses,
    common_prefix_len,
    ends_in_loop,
    exact_match_share,
    has_code,
    loop_share,
    mean_nll,
    parse_share,
    position_agreement,
    prefix_agreement,
    relaxed_share,
)
from specdec.verification import RULE_OPTIONS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CODE_LINES = [
    {"id": "add.py", "prompt": "def add(a, b):\n"},
    {"task_id": "HumanEval/1", "prompt": "class A:\n"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def _bench_args(pair: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return cli_args("bench", pair, prompts, out, 12, 1, *extra)


# ----- variant parsing --------------------------------------------------------------------


def test_split_and_parse_items():
    text = "ar,chain:k=3,static:depth=5,branching=2,eagle2:depth=6,top_k=8,total_tokens=32,dynatree:phase=0,chain@mars:theta=0.85,hf"
    assert split_method_list(text) == [
        "ar",
        "chain:k=3",
        "static:depth=5,branching=2",
        "eagle2:depth=6,top_k=8,total_tokens=32",
        "dynatree:phase=0",
        "chain@mars:theta=0.85",
        "hf",
    ]
    specs = parse_method_specs(text)
    assert [s.text for s in specs] == split_method_list(text)
    static = specs[2]
    assert static.method == "static" and dict(static.options) == {"depth": 5, "branching": 2} and static.rule is None
    mars = specs[5]
    assert mars.rule == "mars" and dict(mars.rule_options) == {"theta": 0.85} and not mars.options
    # CLI-style spellings, AR always first, duplicates dropped
    specs = parse_method_specs("dynatree:prune-tau=0.05,dynatree-phase=1,chain,chain")
    assert [s.text for s in specs] == ["ar", "dynatree:prune_tau=0.05,phase=1", "chain"]
    assert parse_thetas("0.9, 0.84,0.9") == [0.9, 0.84]
    # a switch whose default is None (chosen by the device) still reads on / off, not as text
    specs = parse_method_specs("cast:reads_while_drafting=off,cast:reads-while-drafting=on")
    assert [dict(s.options) for s in specs[1:]] == [{"reads_while_drafting": False}, {"reads_while_drafting": True}]
    with pytest.raises(SpecDecError, match="must be on or off"):
        parse_method_specs("cast:reads_while_drafting=maybe")


def test_variant_labels_options_and_global_flags():
    specs = parse_method_specs("chain,chain:k=3,dynatree:phase=0,static:depth=5,branching=2,chain@mars:theta=0.85,hf")
    variants = make_variants(specs, ["greedy"], 0.0, method_options={"chain": {"k": 4}, "static": {"max_nodes": 16}})
    by_label = {v.label: v for v in variants}
    assert list(by_label) == ["ar", "chain", "chain[k=3]", "dynatree[phase=0]", "static[depth=5,branching=2]", "chain/mars[theta=0.85]", "hf"]
    assert dict(by_label["chain"].options) == {"k": 4}  # the global flag
    assert dict(by_label["chain[k=3]"].options) == {"k": 3}  # the item overrides it
    assert dict(by_label["static[depth=5,branching=2]"].options) == {"max_nodes": 16, "depth": 5, "branching": 2}
    assert by_label["chain/mars[theta=0.85]"].verify == "mars" and by_label["chain/mars[theta=0.85]"].theta == 0.85
    assert by_label["hf"].peer and by_label["ar"].verify == "greedy"
    # several --verify rules: the rule joins the label; --mars-theta is the default theta of mars variants
    labels = [(v.label, v.theta) for v in make_variants(parse_method_specs("chain:k=2"), ["greedy", "mars"], 0.0, mars_theta=0.8)]
    assert labels == [("ar", None), ("chain[k=2]/greedy", None), ("chain[k=2]/mars", 0.8)]


def test_mars_thetas_expand_every_engine_method():
    variants = make_variants(parse_method_specs("chain,dynatree:phase=1,hf"), ["sampling"], 1.0, mars_thetas=[0.85, 0.9])
    assert [v.label for v in variants] == [
        "ar",
        "chain/sampling",
        "chain/mars[theta=0.85]",
        "chain/mars[theta=0.9]",
        "dynatree[phase=1]/sampling",
        "dynatree[phase=1]/mars[theta=0.85]",
        "dynatree[phase=1]/mars[theta=0.9]",
        "hf",
    ]
    assert variants[0].verify == "sampling" and variants[2].base == "chain" and variants[2].theta == 0.85
    with pytest.raises(SpecDecError, match="drop the @rule"):
        make_variants(parse_method_specs("chain@mars"), ["greedy"], 0.0, mars_thetas=[0.9])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("chain:k=0", "item 'chain:k=0': k=0 must be a positive integer"),
        ("chain:depth=3", "depth is not an option of chain; it takes k"),
        ("cast:nonsense=1", "nonsense is not an option of cast; it takes breadth_pruning, buffer, c1, c2, c3, calibrate, cost_profile, depth,"),
        ("chain:k=x", "k='x' must be an integer"),
        ("chain:k=3,k=4", "option k is given twice"),
        ("chain:k", "'k' is not NAME=VALUE"),
        ("chain:theta=0.9", "write chain@mars:theta=0.9"),
        ("chain@fuzzy", "'fuzzy' is not a known accept rule"),
        ("chain@", "nothing after @"),
        ("chain@mars:theta=-1", "item 'chain@mars:theta=-1': MARS theta=-1"),
        ("chain@sampling:chains=nope", "item 'chain@sampling:chains=nope': sampling chains='nope' must be one of block, token"),
        ("chain@mars:chains=token", "chains is an option of the accept rule sampling; write chain@sampling:chains=token"),
        ("dynatree@sampling:segments=blocks", "item 'dynatree@sampling:segments=blocks': sampling segments='blocks' must be one of auto, block, token"),
        ("dynatree:phase=7", "item 'dynatree:phase=7': dynatree phase=7"),
        ("ar:k=3", "ar is the AR baseline and takes no options"),
        ("hf-assisted@mars", "hf-assisted is a Hugging Face peer"),
        ("k=3,chain", "'k=3' is an option but no item before it takes options"),
        ("warp:k=3", "'warp' is not known"),
    ],
)
def test_bad_items(text, needle):
    with pytest.raises(SpecDecError) as info:
        parse_method_specs(text)
    assert needle in str(info.value)


def test_bad_item_rule_for_temperature():
    with pytest.raises(SpecDecError, match="item 'chain@greedy': --verify greedy needs temperature 0"):
        make_variants(parse_method_specs("chain@greedy"), ["sampling"], 0.7)
    with pytest.raises(SpecDecError, match="with the global method flags"):
        make_variants(parse_method_specs("dynatree:d_max=6"), ["greedy"], 0.0, method_options={"dynatree": {"d0": 7}})


# ----- quality metrics on hand-made cases ---------------------------------------------------


def test_agreement_definitions():
    out, ref = [5, 6, 7, 8], [5, 6, 9, 8]
    assert common_prefix_len(out, ref) == 2 and common_prefix_len([], ref) == 0
    assert prefix_agreement([out], [ref]) == 0.5  # 2 equal before the first divergence / 4
    assert position_agreement([out], [ref]) == 0.75  # 3 equal positions / 4
    assert exact_match_share([out, ref], [ref, ref]) == 0.5
    # pooled over rows, over max(len(output), len(reference))
    assert prefix_agreement([out, [1, 2]], [ref, [1, 2, 3]]) == pytest.approx((2 + 2) / (4 + 3))
    assert position_agreement([[1, 2, 3]], [[1, 2]]) == pytest.approx(2 / 3)
    assert prefix_agreement([], []) == 1.0 and exact_match_share([], []) == 1.0
    assert prefix_agreement([ref], [ref]) == 1.0 == position_agreement([ref], [ref])


def test_nll_relaxed_and_parse_definitions():
    assert mean_nll([math.log(0.5), math.log(0.25)]) == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert mean_nll([]) == 0.0
    assert relaxed_share(3, 12) == 0.25 and relaxed_share(0, 0) == 0.0
    assert code_parses("def add(a, b):\n", "    return a + b\n")
    assert code_parses("def add(a, b):\n", "    return a + b\n    x = (1,")  # the partial last line is cut
    assert not code_parses("def add(a, b):\n", "    return a +\n")  # a complete but broken line
    assert not code_parses("def add(a, b):\n", "    return a + b\nclass B:\n")  # a header without its body
    assert not code_parses("x = 1\n", "y = (1,", finished=True)  # ended by EOS: nothing is cut
    assert code_parses("x = 1\n", "y = 2", finished=True)
    assert parse_share([True, False, True, True]) == 0.75 and parse_share([]) is None


@pytest.mark.parametrize(
    ("prompt", "completion", "finished"),
    [
        ("def add(a, b):\n", "    # TODO\n\n    # later\n", False),  # comments and blank lines only
        ("x = 1\n", "# one\n# two", True),  # ended by EOS, still only comments
        ("x = 1", " # trailing comment\n", False),  # a comment appended to the prompt's last line
        ("x = 1\n", "y = 2", False),  # cut at the last complete line: nothing of the completion is kept
        ("x = 1\n", "", True),  # an empty completion
    ],
)
def test_comment_only_completion_is_not_code(prompt, completion, finished):
    assert not code_parses(prompt, completion, finished=finished)


def test_code_after_comments_still_counts():
    assert code_parses("def add(a, b):\n", "    # sum\n    return a + b\n")
    assert code_parses("x = 1", " + 2  # three\n")  # completes the prompt's last line
    assert has_code("# a\n\nb = 1\n") and not has_code("  # a\n\n   \n#b")


@pytest.mark.parametrize(
    ("tokens", "loops"),
    [
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], False),  # no repeat
        ([3, 1, 4, 1, 5, 7, 7, 7, 7, 7, 7, 7], True),  # period 1 over the last half
        ([3, 1, 4, 5, 9, 2, 1, 2, 1, 2, 1, 2], True),  # period 2 over exactly the last half
        ([3, 1, 4, 5, 9, 2, 6, 1, 2, 1, 2, 1, 2], False),  # the same loop, one token short of the last half
        ([8, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], True),  # period 4, two units and more in the last 9
        ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5], False),  # period 5: longer than 4
        ([9, 9, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6], False),  # looped early, not at the end
        ([1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 7], False),  # the loop broke on the last token
        ([5, 4, 6, 6], True),  # shortest visible repeat: a unit of 1 twice in a half of 2
        ([6, 6], False),  # a half of one token cannot show a repeat
        ([], False),
    ],
)
def test_ends_in_loop_hand_built(tokens, loops):
    assert ends_in_loop(tokens) is loops


def test_loop_share_and_period_limit():
    assert loop_share([True, False, False, True]) == 0.5 and loop_share([]) is None
    five = [1, 2, 3, 4, 5] * 4
    assert not ends_in_loop(five) and ends_in_loop(five, max_period=5)


def test_is_code_prompt():
    assert is_code_prompt(BenchPrompt(id="zipfile.py", turns=["import os\n"]))
    assert is_code_prompt(BenchPrompt(id="HumanEval/3", turns=["def f():\n"]))
    assert not is_code_prompt(BenchPrompt(id="81", turns=["Write a poem."]))
    assert is_code_prompt(BenchPrompt(id="81", turns=["x"], language="Python"))
    assert not is_code_prompt(BenchPrompt(id="a.py", turns=["x"], language="rust"))
    assert not is_code_prompt(BenchPrompt(id="a.py", turns=["x", "y"]))  # multi-turn: never
    assert is_code_prompt(BenchPrompt(id="81", turns=["x"]), "all") and not is_code_prompt(BenchPrompt(id="a.py", turns=["x"]), "none")
    with pytest.raises(SpecDecError, match="--code-prompts"):
        is_code_prompt(BenchPrompt(id="a", turns=["x"]), "some")


def test_completion_logprobs_match_a_direct_computation(tiny_pair_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target").eval()
    context, completion = [5, 17, 42], [7, 99, 3, 250]
    got = completion_logprobs(model, context, completion)
    expected = []
    with torch.no_grad():
        for i, tok in enumerate(completion):  # one forward per prefix, the obvious way
            logits = model(torch.tensor([context + completion[:i]])).logits[0, -1]
            expected.append(torch.log_softmax(logits.double(), dim=-1)[tok].item())
    assert got == pytest.approx(expected, abs=1e-4)
    assert mean_nll(got) == pytest.approx(-sum(expected) / len(expected), abs=1e-4)
    assert completion_logprobs(model, context, []) == []


# ----- end to end -----------------------------------------------------------------------------


def test_bench_variants_with_quality(tiny_pair_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "p.jsonl", CODE_LINES)
    out = tmp_path / "out"
    methods = "ar,hf,chain:k=2,chain:k=3,dynatree:phase=0,d0=3,static:depth=2,branching=2"
    assert main(_bench_args(tiny_pair_dir, prompts, out, "--methods", methods, "--quality")) == 0
    results = json.loads((out / "results.json").read_text())
    labels = ["ar", "hf", "chain[k=2]", "chain[k=3]", "dynatree[phase=0,d0=3]", "static[depth=2,branching=2]"]
    assert list(results["methods"]) == labels
    assert results["methods"]["chain[k=2]"]["options"] == {"k": 2}
    assert results["methods"]["dynatree[phase=0,d0=3]"]["options"] == {"phase": 0, "d0": 3}
    ar = results["methods"]["ar"]
    assert ar["nll"] > 0 and ar["parse_rows"] == 2 and ar["parse_share"] is not None
    for label in labels:  # greedy and lossless: every output is AR's, so the quality is AR's
        s = results["methods"][label]
        assert s["matches_ar"] is True, label
        assert s["ar_prefix_agreement"] == 1.0 and s["ar_token_agreement"] == 1.0 and s["exact_match"] == 1.0, label
        assert s["nll"] == pytest.approx(ar["nll"]) and s["nll_delta"] == pytest.approx(0.0, abs=1e-9), label
        assert s["parse_share"] == ar["parse_share"], label
    assert results["methods"]["chain[k=2]"]["relaxed_share"] == 0.0 and results["methods"]["hf"]["relaxed_share"] is None
    assert all(r["nll"] is not None and len(r["parses"]) == 1 for r in results["records"])
    for label in labels:  # the loop share pools every row, by the definition in specdec.stats
        rows = [r for r in results["records"] if r["label"] == label]
        flags = [ends_in_loop(out) for r in rows for out in r["outputs"]]
        assert [f for r in rows for f in r["loops"]] == flags, label
        assert results["methods"][label]["loop_rows"] == len(flags) and results["methods"][label]["loop_share"] == loop_share(flags), label
    report = (out / "report.md").read_text()
    assert "## Quality" in report and "| dynatree[phase=0,d0=3] |" in report and "AR prefix agreement" in report and "| loops |" in report


@pytest.mark.skipif("mars" not in RULE_OPTIONS, reason="the MARS accept rule (--verify mars) is not available in this checkout")
@pytest.mark.parametrize("temperature", ["0", "1"])
def test_bench_mars_theta_sweep(tiny_pair_dir, tmp_path, temperature):
    prompts = _write_jsonl(tmp_path / "p.jsonl", CODE_LINES)
    out = tmp_path / "out"
    extra = ["--methods", "chain:k=3,static:depth=2,branching=2", "--mars-thetas", "0.3,0.9", "--temperature", temperature, "--seed", "1"]
    assert main(_bench_args(tiny_pair_dir, prompts, out, *extra)) == 0
    results = json.loads((out / "results.json").read_text())
    strict = "greedy" if temperature == "0" else "sampling"
    assert list(results["methods"]) == [
        "ar",
        f"chain[k=3]/{strict}",
        "chain[k=3]/mars[theta=0.3]",
        "chain[k=3]/mars[theta=0.9]",
        f"static[depth=2,branching=2]/{strict}",
        "static[depth=2,branching=2]/mars[theta=0.3]",
        "static[depth=2,branching=2]/mars[theta=0.9]",
    ]
    for label, s in results["methods"].items():
        assert s["nll"] is not None and s["ar_prefix_agreement"] is not None, label
        if s["verify"] == "mars":
            assert s["theta"] in (0.3, 0.9) and s["lossless"] is False and 0.0 <= s["relaxed_share"] <= 1.0
    if temperature == "0":
        assert results["methods"]["chain[k=3]/greedy"]["ar_prefix_agreement"] == 1.0
    assert results["config"]["mars_thetas"] == [0.3, 0.9] and results["config"]["quality"] is True
    assert (out / "mars_sweep.png").read_bytes()[:8] == PNG_MAGIC
    assert "mars_sweep.png" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--methods", "chain:k=0"], "item 'chain:k=0'"),
        (["--methods", "chain@mars", "--mars-thetas", "0.9"], "drop the @rule"),
        (["--methods", "chain", "--mars-thetas", "0.9", "--verify", "greedy"], "drop --verify greedy"),
        (["--methods", "chain", "--mars-thetas", "0.9", "--mars-theta", "0.8"], "not both"),
        (["--methods", "chain", "--mars-thetas", "0.9,x"], "'x' is not a number"),
        (["--methods", "chain", "--mars-theta", "0.8"], "--mars-theta applies only to --verify mars"),
        (["--methods", "static:depth=2", "--k", "3"], "--k applies to none"),
    ],
)
def test_bench_variant_errors_exit_2(tiny_pair_dir, tmp_path, capsys, extra, needle):
    prompts = _write_jsonl(tmp_path / "p.jsonl", CODE_LINES[:1])
    assert main(_bench_args(tiny_pair_dir, prompts, tmp_path / "out", *extra)) == 2
    assert needle in capsys.readouterr().err
