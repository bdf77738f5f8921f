"""The `specdec generate` command and the Python API on a tiny saved pair: JSON output,
every method, seeds, and clear errors (exit code 2, no traceback) for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.api import SpeculativeDecoder
from specdec.cli import build_parser, collect_method_options, main
from specdec.errors import SpecDecError


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("method", ["ar", "chain", "static", "eagle2"])
def test_generate_json_every_method(capsys, tiny_pair_dir, method):
    code, out, err = run_cli(
        capsys, "generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"),
        "--method", method, "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--json",
    )
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    assert set(line) == {"text", "token_ids", "finish_reason", "stats"}
    assert set(line["stats"]) == {"tau", "acceptance_rate", "tokens_per_s", "steps", "ttft_ms", "tpot_ms"}
    assert 1 <= len(line["token_ids"]) <= 12
    # token_ids are the generated tokens only, and equal the target's own greedy continuation
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target")
    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="ar")
    ids = decoder.encode("def add(a, b):")
    ref = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids) :].tolist()
    assert line["token_ids"] == ref
    assert line["stats"]["tau"] >= 1.0


def test_api_seeded_sampling_is_reproducible(tiny_pair_dir):
    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="chain", k=3)
    a = decoder.generate("for i in", max_new_tokens=16, temperature=1.0, seed=3)
    b = decoder.generate("for i in", max_new_tokens=16, temperature=1.0, seed=3)
    assert a.token_ids == b.token_ids
    assert a.text == decoder.tokenizer.decode(a.token_ids, skip_special_tokens=True)
    batch = decoder.generate(["for i in", "class A:"], max_new_tokens=8)
    assert len(batch) == 2 and all(r.token_ids for r in batch)


BAD_INPUTS = {
    "empty prompt": (["--prompt", ""], "prompt is empty"),
    "zero tokens": (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens=0"),
    "negative temperature": (["--prompt", "x", "--temperature", "-1"], "temperature=-1.0"),
    "top_p zero": (["--prompt", "x", "--top-p", "0"], "top_p=0.0"),
    "top_p above one": (["--prompt", "x", "--top-p", "1.5"], "top_p=1.5"),
    "greedy verify with temperature": (["--prompt", "x", "--verify", "greedy", "--temperature", "0.5"], "--verify sampling"),
    "unknown method": (["--prompt", "x", "--method", "nope"], "--method 'nope'"),
    "option of another method": (["--prompt", "x", "--method", "static", "--k", "3"], "--k does not apply"),
    "bad option value": (["--prompt", "x", "--method", "chain", "--k", "0"], "k=0"),
    "no prompt": ([], "--prompt"),
    "prompt over context": (["--prompt", "x " * 400], "context"),
    "budget over context": (["--prompt", "x", "--max-new-tokens", "1000"], "lower max_new_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exit_2_with_message(capsys, tiny_pair_dir, case):
    extra, needle = BAD_INPUTS[case]
    code, _, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), *extra)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err


def test_train_evaluate_target_without_draft(capsys, tiny_pair_dir):
    """A custom target with no --draft: a clear error naming the fix, not the engine's "--method chain needs a draft"."""
    code, _, err = run_cli(capsys, "train", "evaluate", "--target", str(tiny_pair_dir / "target"), "--no-latency")
    assert code == 2 and "needs --draft too" in err and "Traceback" not in err


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--target", str(tmp_path / "missing"), "--draft", str(tmp_path / "missing2"), "--prompt", "x")
    assert code == 2 and "does not exist" in err


def test_mismatched_tokenizers_refused(tiny_pair_dir, tmp_path):
    from specdec.training.tokenizer import train_tokenizer

    other = tmp_path / "other"
    tok = train_tokenizer(["something else entirely\n"] * 20, other, vocab_size=300, min_frequency=1)
    AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "draft").save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(SpecDecError, match="tokenizers differ"):
        SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(other), method="chain")


def test_console_script_exit_code(tiny_pair_dir):
    """The installed entry point: a bad value gives exit 2 and a one-line error, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--prompt", "x", "--top-p", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "top_p=2.0" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_stream_and_prompt_file(capsys, tiny_pair_dir, tmp_path):
    """--stream prints the prompt then the text as it is committed; --prompt-file reads the prompt."""
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("def add(a, b):")
    pair = ["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--max-new-tokens", "10"]
    code, out, _ = run_cli(capsys, "generate", *pair, "--prompt-file", str(prompt_file), "--json")
    assert code == 0
    expected = json.loads(out.strip().splitlines()[-1])["text"]
    code, streamed, err = run_cli(capsys, "generate", *pair, "--prompt-file", str(prompt_file), "--stream")
    assert code == 0 and "tok/s" in err
    assert streamed == "def add(a, b):" + expected + "\n"  # prompt, streamed text, final newline
    code, _, err = run_cli(capsys, "generate", *pair, "--prompt-file", str(tmp_path / "missing.txt"))
    assert code == 2 and "does not exist" in err
    # one new token: the prefill's, no verification step, so no tau or acceptance to report
    code, _, err = run_cli(capsys, "generate", *pair[:4], "--max-new-tokens", "1", "--prompt-file", str(prompt_file))
    assert code == 0 and "1 tokens" in err and "tau n/a, acceptance n/a, 0 steps" in err
    assert "tau n/a" not in run_cli(capsys, "generate", *pair, "--prompt-file", str(prompt_file))[2]


@pytest.mark.parametrize("method", ["chain", "dynatree"])
def test_generate_several_prompts_batched(capsys, tiny_pair_dir, method):
    """--prompt repeated with --batch-size: rows decoded together, one JSON line per prompt in the
    order given, each equal to that prompt's own greedy continuation."""
    prompts = ["def add(a, b):", "import os", "class A:\n    def"]
    pair = ["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--max-new-tokens", "10"]
    args = [a for p in prompts for a in ("--prompt", p)]
    code, out, err = run_cli(capsys, "generate", *pair, "--method", method, *args, "--batch-size", "2", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert [line["prompt_index"] for line in lines] == [0, 1, 2]
    assert "3 prompts, batch size 2" in err
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target")
    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="ar")
    for prompt, line in zip(prompts, lines, strict=True):
        ids = decoder.encode(prompt)
        ref = target.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(ids) :].tolist()
        assert line["token_ids"] == ref, prompt
    code, out, _ = run_cli(capsys, "generate", *pair, *args)
    assert code == 0 and out.count("--- prompt ") == 3 and prompts[1] in out


def test_generate_several_prompts_bad_input(capsys, tiny_pair_dir):
    pair = ["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft")]
    for extra, needle in (
        (["--prompt", "a", "--prompt", "b", "--batch-size", "0"], "--batch-size 0"),
        (["--prompt", "a", "--prompt", "b", "--stream"], "drop --stream"),
        (["--prompt", "a", "--prompt", "b", "--image", "x.png"], "--image goes with one prompt"),
    ):
        code, _, err = run_cli(capsys, "generate", *pair, *extra)
        assert code == 2 and needle in err and "Traceback" not in err


def test_seeded_sampling_depends_on_the_batch(tiny_pair_dir):
    """What the README and `generate`'s docstring say: a seed reproduces a call with the same
    prompts, order and batch size; a prompt's sampled text changes with its batch, even for ar."""
    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), method="ar")
    kwargs = {"max_new_tokens": 16, "temperature": 1.0, "seed": 3}
    alone = decoder.generate("for i in", **kwargs).token_ids
    assert decoder.generate("for i in", **kwargs).token_ids == alone
    first = decoder.generate(["for i in", "class A:"], **kwargs)[0].token_ids
    second = decoder.generate(["class A:", "for i in"], **kwargs)[1].token_ids
    assert decoder.generate(["for i in", "class A:"], **kwargs)[0].token_ids == first
    assert len({tuple(alone), tuple(first), tuple(second)}) > 1


def test_method_flags_are_the_policy_fields():
    """The flags read from the policy sources with ast are exactly the dataclasses' init fields
    (names, types, defaults), each flag parses into the field it names, and none is hand-kept."""
    import dataclasses
    import inspect

    from specdec.method_flags import NOT_OPTIONS, POLICY_SOURCES, SCALARS, method_flags, policy_fields
    from specdec.methods import POLICY_CLASSES, method_options

    assert tuple(POLICY_SOURCES) == tuple(POLICY_CLASSES)
    for method, cls in POLICY_CLASSES.items():
        path, name = POLICY_SOURCES[method]
        assert cls.__name__ == name and inspect.getsourcefile(cls).endswith(path)
        read = {f.name: f for f in policy_fields()[method]}
        expected = {}
        if dataclasses.is_dataclass(cls):
            for f in dataclasses.fields(cls):
                kinds = [k.strip() for k in str(f.type).split("|") if k.strip() != "None"]  # annotations are strings here
                if f.init and f.name not in NOT_OPTIONS and len(kinds) == 1 and kinds[0] in SCALARS:
                    expected[f.name] = (kinds[0], f.default)
        assert {n: (f.type, f.default) for n, f in read.items()} == expected, method
        assert set(read) <= set(method_options(method))
    assert policy_fields()["dynatree"][0].doc.startswith("D_0, base depth")
    parser = build_parser()
    for flag in method_flags():
        method = next(iter(flag.methods))
        value = {"int": "3", "float": "0.5", "str": "x", "bool": "off"}[flag.type]
        args = parser.parse_args(["generate", "--method", method, flag.flag, value])
        assert collect_method_options(args, method) == {flag.field: {"int": 3, "float": 0.5, "str": "x", "bool": False}[flag.type]}


def test_method_flag_help_names_each_method_and_default():
    from specdec.method_flags import method_flags

    helps = {f.flag: f.help() for f in method_flags()}
    assert helps["--depth"].startswith("static/eagle2: levels below the root (4 / 6); cast: maximum tree depth H")
    assert helps["--expand-top-k"] == "eagle2/cast: K: children per expanded node and candidates per layer (8 / 12)"
    assert helps["--breadth-pruning"] == "cast: breadth pruning (on)"


FAMILIES = ("llama", "qwen2", "gpt_neox", "gpt2", "mistral", "gemma2")
"""six architecture families; mistral (every layer slides) and gemma2 (alternating sliding and
full layers) with a 6-token window, shorter than prompt + output"""


def _family_config(arch: str, vocab: int, eos: int, layers: int):
    from conftest import tiny_config
    from transformers import Gemma2Config, MistralConfig

    common = {"vocab_size": vocab, "eos_token_id": eos, "bos_token_id": eos, "pad_token_id": 0, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    if arch == "mistral":
        return MistralConfig(sliding_window=6, **common)
    if arch == "gemma2":
        return Gemma2Config(sliding_window=6, head_dim=8, attn_implementation="eager", **common)
    return tiny_config(arch, layers=layers, vocab=vocab, eos=eos)


@pytest.mark.parametrize("arch", FAMILIES)
def test_cli_greedy_equals_generate_on_six_architecture_families(capsys, tmp_path, tiny_pair_dir, arch):
    from conftest import sharpen
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        torch.manual_seed(seed)
        model = sharpen(AutoModelForCausalLM.from_config(_family_config(arch, len(tok), tok.eos_token_id, layers)).eval())
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompt = "def add(a, b):\n    return a + b\nfor i in range(10):"
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    ids = tok(prompt)["input_ids"]
    ref = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=tok.eos_token_id)[0, len(ids) :].tolist()
    for method in ("chain", "eagle2"):
        code, out, err = run_cli(
            capsys, "generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--device", "cpu",
            "--method", method, "--prompt", prompt, "--max-new-tokens", "12", "--json",
        )
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["token_ids"] == ref, (arch, method)
