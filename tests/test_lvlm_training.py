"""`specdec train lvlm`: training sequences match what the processor builds at inference;
a tiny run saves a pair that loads and decodes with images."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoProcessor

from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.multimodal.inputs import encode_multimodal
from specdec.multimodal.scenes import format_conversation, generate_examples
from specdec.training.lvlm import LvlmSize, make_processor, train_lvlm_tokenizer
from specdec.training.lvlm_train import IGNORE, encode_example


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lvlm")
    assert main(["train", "lvlm", "--out", str(out), "--tiny", "--steps", "4", "--batch-size", "4"]) == 0
    return out


def test_training_sequence_prefixes_equal_inference_prompts():
    """Every answer's prompt, encoded by the processor as at inference, is a prefix of the
    training sequence, and the labels are exactly the answer tokens (EOS included)."""
    examples = generate_examples(60, 3, "train")
    tok = train_lvlm_tokenizer([format_conversation(e.turns) for e in examples], vocab_size=400)
    size = LvlmSize(vision_hidden=16, vision_layers=1, vision_heads=1, text_hidden=16, text_layers=1, text_heads=1, image_size=96, patch_size=32)
    processor = make_processor(tok, size)
    for ex in examples:
        ids, labels = encode_example(ex, tok, size.image_tokens)
        assert len(ids) == len(labels)
        for k, (_, answer) in enumerate(ex.turns):
            prompt = encode_multimodal(processor, format_conversation(ex.turns, upto=k), ex.images())
            n = len(prompt.token_ids)
            assert ids[:n] == prompt.token_ids
            reply = tok(f" {answer}</s>")["input_ids"]
            assert labels[n : n + len(reply)] == reply and labels[n - 1] == IGNORE


def test_tiny_run_saves_a_loadable_pair(tiny_run):
    log = json.loads((tiny_run / "train_log.json").read_text())
    assert log["steps"] == 4 and log["target_params"] > log["draft_params"]
    processor = AutoProcessor.from_pretrained(tiny_run / "target")
    assert type(processor).__name__ == "LlavaProcessor"
    dec = SpeculativeDecoder.from_pretrained(str(tiny_run / "target"), str(tiny_run / "draft"), method="chain", device="cpu", k=3)
    assert dec.multimodal and dec.draft_view() is None
    example = generate_examples(1, 0, "eval", tasks=["colour"])[0]
    prompt = format_conversation(example.turns, upto=0)
    out = dec.generate(prompt, max_new_tokens=6, images=example.images())
    ids = encode_multimodal(processor, prompt, example.images())
    with torch.no_grad():
        ref = dec.target.generate(
            input_ids=torch.tensor([ids.token_ids]), **ids.model_inputs, max_new_tokens=6, do_sample=False
        )[0, len(ids) :].tolist()
    assert out.token_ids == ref


def test_bad_arguments(tmp_path, capsys):
    assert main(["train", "lvlm", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps=0" in capsys.readouterr().err


def test_evaluate_lvlm_figures(tiny_run, capsys):
    out = tiny_run / "card.json"
    assert main(["train", "evaluate-lvlm", "--target", str(tiny_run / "target"), "--draft", str(tiny_run / "draft"), "--per-task", "2", "--device", "cpu", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures["tasks"]) >= {"count", "colour", "change", "followup"}
    for row in figures["tasks"].values():
        assert all(0.0 <= v <= 1.0 for v in row.values())
    assert figures["step_ms"]["target"] > 0 and figures["params"]["target"] > figures["params"]["draft"]


def test_bundle_copies_the_shippable_files(tiny_run, tmp_path):
    from specdec.errors import SpecDecError
    from specdec.training.lvlm_train import bundle_lvlm

    dest = bundle_lvlm(tiny_run, tmp_path / "assets")
    assert sorted(p.name for p in dest.iterdir()) == ["draft", "target", "train_log.json"]
    assert (dest / "target" / "config.json").is_file()
    with pytest.raises(SpecDecError, match="specdec train lvlm"):
        bundle_lvlm(tmp_path / "empty", tmp_path / "elsewhere")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--minutes", "nan"], "--minutes=nan must be a positive number"),
        (["--minutes", "inf"], "--minutes=inf must be a positive number"),
        (["--steps", "1", "--vision-lr-scale", "nan"], "--vision-lr-scale=nan must be a number >= 0"),
        (["--steps", "1", "--threads", "-3"], "--threads=-3 must be >= 0"),
        (["--steps", "1", "--seed", "-1"], "--seed -1 must be at least 0"),
    ],
)
def test_bad_numbers_before_training(tmp_path, capsys, monkeypatch, args, needle):
    import specdec.training.lvlm_train

    monkeypatch.setattr(specdec.training.lvlm_train, "train_lvlm", lambda *a, **k: pytest.fail("training started before the bad value was reported"))
    assert main(["train", "lvlm", "--out", str(tmp_path / "out"), "--tiny", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: ") and needle in err and "Traceback" not in err


def test_evaluate_lvlm_target_without_draft(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(SpeculativeDecoder, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded before the bad value was reported"))
    assert main(["train", "evaluate-lvlm", "--target", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--target" in err and "needs --draft too" in err and "--method" not in err
