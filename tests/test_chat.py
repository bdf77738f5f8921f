"""Instruct workflow: chat templates (`--chat`, `messages=`, `--system`), stop strings in
`generate` (API and CLI, batched and streamed), the no-template error, and `bench --chat`
with a per-category table. On the tiny saved pair, whose tokenizer gets a small template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli_args
from transformers import AutoTokenizer

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import BenchPrompt
from specdec.bench.runner import turn_context
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.text import chat_prompt

TEMPLATE = "{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}bot>{% endif %}"
"""a small Jinja chat template (the tiny tokenizer has none)"""


@pytest.fixture(scope="module")
def chat_pair_dir(tiny_pair_dir, tmp_path_factory) -> Path:
    """A copy of the tiny pair whose tokenizer (target's and draft's) carries TEMPLATE."""
    root = tmp_path_factory.mktemp("chat_pair")
    for name in ("target", "draft"):
        shutil.copytree(tiny_pair_dir / name, root / name)
        tok = AutoTokenizer.from_pretrained(root / name)
        tok.chat_template = TEMPLATE
        tok.save_pretrained(root / name)
    return root


def decoder_for(pair: Path, **kwargs) -> SpeculativeDecoder:
    return SpeculativeDecoder.from_pretrained(str(pair / "target"), str(pair / "draft"), method="chain", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def chat_decoder(chat_pair_dir) -> SpeculativeDecoder:
    return decoder_for(chat_pair_dir)


@pytest.fixture(scope="module")
def plain_decoder(tiny_pair_dir) -> SpeculativeDecoder:
    return decoder_for(tiny_pair_dir)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def pair_flags(pair: Path) -> list[str]:
    return ["--target", str(pair / "target"), "--draft", str(pair / "draft"), "--device", "cpu"]


# ----- chat templates ---------------------------------------------------------------------


def test_chat_prompt_applies_the_template_with_system(chat_decoder):
    text = chat_decoder.chat_prompt([{"role": "user", "content": "def add"}], system="be brief")
    assert text == "system> be brief\nuser> def add\nbot>"
    assert chat_decoder.chat_prompt([("user", "a"), ("assistant", "b"), ("user", "c")]) == "user> a\nassistant> b\nuser> c\nbot>"
    # the template's text is tokenized as it is (no special tokens added: a template holds its own)
    assert chat_decoder.encode_chat([("user", "def add")]) == chat_decoder.tokenizer("user> def add\nbot>", add_special_tokens=False)["input_ids"]
    with pytest.raises(SpecDecError, match="give the system prompt once"):
        chat_decoder.chat_prompt([("system", "x"), ("user", "y")], system="z")
    with pytest.raises(SpecDecError, match=r"messages\[0\] has role 'robot'"):
        chat_decoder.chat_prompt([{"role": "robot", "content": "y"}])
    with pytest.raises(SpecDecError, match="either prompt .* or messages"):
        chat_decoder.generate("x", messages=[("user", "y")])
    with pytest.raises(SpecDecError, match="system= goes with messages="):
        chat_decoder.generate("x", system="s")


def test_cli_chat_output_equals_the_api_with_messages(capsys, chat_pair_dir, chat_decoder):
    code, out, err = run_cli(
        capsys, "generate", *pair_flags(chat_pair_dir), "--chat", "--system", "be brief", "--prompt", "def add(a, b):",
        "--max-new-tokens", "12", "--json",
    )
    assert code == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    api = chat_decoder.generate(messages=[{"role": "user", "content": "def add(a, b):"}], system="be brief", max_new_tokens=12)
    assert line["token_ids"] == api.token_ids and line["text"] == api.text and line["finish_reason"] == api.finish_reason
    # and that is the continuation of the templated prompt, not of the raw text
    ids = chat_decoder.tokenizer("system> be brief\nuser> def add(a, b):\nbot>", add_special_tokens=False)["input_ids"]
    from specdec.sampling import SamplingParams

    assert chat_decoder.generate_ids([ids], 12, SamplingParams())[0].token_ids == api.token_ids
    assert api.token_ids != chat_decoder.generate("def add(a, b):", max_new_tokens=12).token_ids
    # a batch of chats through the CLI: one result per prompt, the reply only (no template text)
    code, out, err = run_cli(capsys, "generate", *pair_flags(chat_pair_dir), "--chat", "--prompt", "for i in", "--prompt", "class A:", "--max-new-tokens", "6")
    assert code == 0, err
    batch = chat_decoder.generate(messages=[[("user", "for i in")], [("user", "class A:")]], max_new_tokens=6)
    assert out == "".join(f"--- prompt {i + 1} of 2 ---\n{r.text}\n" for i, r in enumerate(batch))
    assert "bot>" not in out


def test_no_chat_template_is_a_one_line_error(capsys, tiny_pair_dir, plain_decoder, tmp_path):
    code, out, err = run_cli(capsys, "generate", *pair_flags(tiny_pair_dir), "--chat", "--prompt", "hi")
    assert code == 2 and out == ""
    assert len([line for line in err.splitlines() if line.startswith("specdec: error:")]) == 1 and "Traceback" not in err
    assert str(tiny_pair_dir / "target") in err  # names the model...
    assert "needs a chat template" in err and "instruct" in err and "drop --chat" in err  # ...and says what to do
    with pytest.raises(SpecDecError, match="messages= needs a chat template, and the tokenizer of .*target' has none"):
        plain_decoder.generate(messages=[("user", "hi")])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    code, _, err = run_cli(capsys, *cli_args("bench", tiny_pair_dir, prompts, tmp_path / "out", 4, 1, "--methods", "ar", "--chat"))
    assert code == 2 and "--chat needs a chat template" in err and "Traceback" not in err
    # the server keeps its plain template for such tokenizers
    assert chat_prompt(plain_decoder.tokenizer, [("user", "hi")]) == ("user: hi\nassistant:", False)


# ----- stop strings -------------------------------------------------------------------------

PROMPTS = ["def add(a, b):", "for i in"]


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _pick_stop(text: str, other: str) -> str:
    """A short printable piece of `text` (not at its start) that `other` does not hold."""
    for start in range(1, len(text) - 2):
        piece = text[start : start + 2]
        if piece.isascii() and piece.isprintable() and piece not in other and piece not in text[:start]:
            return piece
    raise AssertionError(f"no stop string to pick in {text!r}")


def test_stop_strings_end_each_row_early_in_a_batch(plain_decoder):
    full = plain_decoder.generate(PROMPTS, max_new_tokens=30)
    assert all(r.finish_reason == "length" for r in full)
    stops = [_pick_stop(full[0].text, full[1].text), _pick_stop(full[1].text, full[0].text)]
    cuts = [_first_stop(r.text, stops) for r in full]
    assert None not in cuts
    stopped = plain_decoder.generate(PROMPTS, max_new_tokens=30, stop=stops)
    for r, ref, cut in zip(stopped, full, cuts, strict=True):
        assert r.finish_reason == "stop"
        assert r.text == ref.text[:cut]  # cut just before the first stop string
        assert ref.token_ids[: len(r.token_ids)] == r.token_ids and len(r.token_ids) < len(ref.token_ids)
        assert plain_decoder.tokenizer.decode(r.token_ids).startswith(r.text)
        assert r.stats.new_tokens < 30  # the row stopped decoding there, not at max_new_tokens
    assert len(stopped[0].token_ids) != len(stopped[1].token_ids) or cuts[0] != cuts[1]
    # alone, each row stops at the same place (greedy output does not depend on the batch)
    alone = plain_decoder.generate(PROMPTS[1], max_new_tokens=30, stop=stops)
    assert (alone.text, alone.token_ids) == (stopped[1].text, stopped[1].token_ids)
    with pytest.raises(SpecDecError, match="non-empty"):
        plain_decoder.generate(PROMPTS[0], stop=[""])


def test_streams_never_pass_a_stop_string(plain_decoder, capsys, tiny_pair_dir):
    full = plain_decoder.generate(PROMPTS[0], max_new_tokens=30)
    stop = _pick_stop(full.text, "")
    pieces: list[str] = []
    tokens: list[int] = []
    result = plain_decoder.generate(
        PROMPTS[0], max_new_tokens=30, stop=[stop], stream_text=lambda i, t: pieces.append(t), stream=lambda i, t: tokens.extend(t)
    )
    assert result.finish_reason == "stop" and result.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == result.text and all(stop not in p for p in pieces)
    assert tokens == result.token_ids
    # without stop strings the text stream still adds up to the text
    pieces.clear()
    plain = plain_decoder.generate(PROMPTS[0], max_new_tokens=30, stream_text=lambda i, t: pieces.append(t))
    assert "".join(pieces) == plain.text == full.text
    # the CLI's --stream prints the prompt, then the text up to the stop string
    code, out, err = run_cli(capsys, "generate", *pair_flags(tiny_pair_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "30", "--stop", stop, "--stream")
    assert code == 0, err
    assert out == PROMPTS[0] + result.text + "\n"
    code, out, err = run_cli(capsys, "generate", *pair_flags(tiny_pair_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "30", "--stop", stop, "--json")
    line = json.loads(out)
    assert (line["text"], line["token_ids"], line["finish_reason"]) == (result.text, result.token_ids, "stop")


# ----- bench --chat and categories ---------------------------------------------------------


def test_turn_context_with_chat(chat_decoder):
    tok = chat_decoder.tokenizer
    single = BenchPrompt(id="a", turns=["def add"])
    assert turn_context(tok, single, 0, None, [], [tok.eos_token_id]) == tok("def add")["input_ids"]  # without --chat: raw text
    assert turn_context(tok, single, 0, None, [], [tok.eos_token_id], chat=True, system="s") == chat_decoder.encode_chat([("user", "def add")], system="s")
    conv = BenchPrompt(id="b", turns=["x", "y"])
    answer = tok("ok", add_special_tokens=False)["input_ids"]
    assert turn_context(tok, conv, 1, None, [answer], [tok.eos_token_id], chat=True) == chat_decoder.encode_chat([("user", "x"), ("assistant", "ok"), ("user", "y")])


def test_bench_chat_and_per_category_table(chat_pair_dir, chat_decoder, tmp_path, capsys):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["def add(a, b):\n", "class A:\n"]},
        {"question_id": 2, "category": "translation", "turns": ["for i in range(10):\n"]},
        {"question_id": 3, "category": "translation", "turns": ["class A:\n"]},
        {"question_id": 4, "category": "math_reasoning", "turns": ["print(i)\n"]},
    ]
    prompts = tmp_path / "question.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, *cli_args("bench", chat_pair_dir, prompts, out, 6, 1, "--methods", "ar,chain", "--num-prompts", "0", "--chat", "--system", "be brief")
    )
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    # every prompt went through the template (single-turn ones too)
    first = next(r for r in results["records"] if r["prompt_ids"] == ["2"] and r["label"] == "ar")
    assert first["context_tokens"] == [len(chat_decoder.encode_chat([("user", "for i in range(10):\n")], system="be brief"))]
    assert results["config"]["chat"] is True and results["config"]["system"] == "be brief"
    categories = results["categories"]
    assert list(categories) == ["writing", "translation", "math_reasoning"]
    for figures in categories.values():
        assert set(figures) == {"ar", "chain"}
        assert figures["ar"]["speedup"] == pytest.approx(1.0) and figures["chain"]["tau"] >= 1.0
    assert categories["translation"]["ar"]["prompts"] == 2 and categories["translation"]["ar"]["calls"] == 2
    assert categories["writing"]["chain"]["calls"] == 2  # two turns
    report = (out / "report.md").read_text()
    assert "## Per category" in report
    table = report.split("## Per category", 1)[1].split("\n## ", 1)[0]
    assert table.count("| translation | 2 | ") == 2 and table.count("| writing | 1 | ") == 2 and table.count("| math_reasoning | 1 | ") == 2
    assert "**Chat**" in report


def test_no_category_no_table(tiny_pair_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    code, _, err = run_cli(capsys, *cli_args("bench", tiny_pair_dir, prompts, tmp_path / "out", 4, 1, "--methods", "ar"))
    assert code == 0, err
    assert "## Per category" not in (tmp_path / "out" / "report.md").read_text()
    assert json.loads((tmp_path / "out" / "results.json").read_text())["categories"] == {}
