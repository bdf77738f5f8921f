"""The pair-training code path on a tiny budget: outputs load with the Auto classes, resume works."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.cli import main
from specdec.training.corpus import is_heldout, list_sources, split_sources

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_split_is_deterministic_and_disjoint():
    files = list_sources([STDLIB / "json", STDLIB / "email"])
    train, heldout = split_sources(files)
    assert train and heldout
    assert not {f.module for f in train} & {f.module for f in heldout}
    assert split_sources(list(reversed(files))) == (train, heldout) or {f.module for f in split_sources(list(reversed(files)))[1]} == {f.module for f in heldout}
    assert is_heldout("a/b.py") == is_heldout("a/b.py")


def test_tiny_pair_training_and_resume(tmp_path):
    out = tmp_path / "pair"
    args = ["train", "pair", "--tiny", "--corpus", str(STDLIB / "json"), str(STDLIB / "email"), "--out", str(out),
            "--vocab-size", "320", "--seq-len", "32", "--target-steps", "3", "--draft-steps", "2"]
    assert main(args) == 0
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(out / name)
        tok = AutoTokenizer.from_pretrained(out / name)
        assert model.config.model_type == "gpt_neox"
        assert len(tok) == model.config.vocab_size
        assert (out / name / "model.safetensors").exists()
    prompts = [json.loads(line) for line in (out / "stdlib-heldout.jsonl").read_text().splitlines()]
    assert prompts and {"id", "prompt", "reference"} <= set(prompts[0])
    log = json.loads((out / "train_log.json").read_text())
    assert log["summary"]["target_params"] > log["summary"]["draft_params"]
    # resume: more steps continue from the checkpoint instead of starting over
    assert main([*args[:-4], "--target-steps", "5", "--draft-steps", "2"]) == 0
    log2 = json.loads((out / "train_log.json").read_text())
    target_steps = [r["step"] for r in log2["log"] if r["stage"] == "target"]
    assert min(target_steps) >= 3 and max(target_steps) == 4


def test_bundle_copies_shippable_files_only(tmp_path):
    from specdec.errors import SpecDecError
    from specdec.training.pair import BUNDLE_FILES, bundle_pair

    src = tmp_path / "run"
    for name in BUNDLE_FILES:
        if name.endswith((".json", ".jsonl")):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text("{}")
        else:
            (src / name).mkdir(parents=True)
            (src / name / "config.json").write_text("{}")
    (src / "work").mkdir()
    (src / "work" / "target.ckpt").write_text("big")
    dest = bundle_pair(src, tmp_path / "assets")
    assert sorted(p.name for p in dest.iterdir()) == sorted(BUNDLE_FILES)
    with pytest.raises(SpecDecError, match="lacks"):
        bundle_pair(tmp_path / "nothing", tmp_path / "assets2")


def test_train_draft_against_existing_target(tmp_path):
    """--target-from reuses a trained target unchanged and trains only the draft."""
    first = tmp_path / "first"
    base = ["train", "pair", "--tiny", "--corpus", str(STDLIB / "json"), "--vocab-size", "320", "--seq-len", "32"]
    assert main([*base, "--out", str(first), "--target-steps", "2", "--draft-steps", "1"]) == 0
    second = tmp_path / "second"
    assert main([*base, "--out", str(second), "--tokenizer", str(first / "tokenizer"), "--target-from", str(first / "target"),
                 "--distill-weight", "0", "--draft-steps", "2"]) == 0
    a = AutoModelForCausalLM.from_pretrained(first / "target").state_dict()
    b = AutoModelForCausalLM.from_pretrained(second / "target").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((second / "train_log.json").read_text())
    assert {r["stage"] for r in log["log"]} == {"draft"}


def test_evaluate_pair_figures(tiny_pair_dir):
    from specdec.api import SpeculativeDecoder
    from specdec.training.evaluate import evaluate_pair

    dec = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"))
    figures = evaluate_pair(dec.target, dec.draft, dec.tokenizer, [STDLIB / "json"], max_tokens=256, window=64, latency_context=32)
    assert figures["tokens"] > 0
    assert figures["target_perplexity"] > 1 and figures["draft_perplexity"] > 1
    assert 0 <= figures["top1_agreement"] <= 1
    assert set(figures["latency_ms"]["target"]) == {1, 16, 64} and all(v > 0 for v in figures["latency_ms"]["draft"].values())
    assert figures["target_params"] > figures["draft_params"]


def test_one_bpe_builder_for_text_and_vision_tokenizers(tmp_path):
    """The text pair's and the LVLM pair's tokenizers come from one builder: the same
    specials in the same order (EOS = BOS, then pad, then the image token for LVLMs)."""
    from specdec.multimodal.inputs import IMAGE_PLACEHOLDER
    from specdec.training.lvlm import train_lvlm_tokenizer
    from specdec.training.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    texts = ["USER: <image>\nWhat is on the left? ASSISTANT: a red cube"] * 40 + ["def f(x):\n    return x + 1\n"] * 40
    text = train_tokenizer(texts, tmp_path / "tok", vocab_size=320)
    assert [text.convert_ids_to_tokens(i) for i in (0, 1)] == [EOS_TOKEN, PAD_TOKEN]
    assert text.bos_token == text.eos_token == EOS_TOKEN and text.model_max_length == 2048
    assert IMAGE_PLACEHOLDER not in text.get_vocab() and AutoTokenizer.from_pretrained(tmp_path / "tok").get_vocab() == text.get_vocab()
    vision = train_lvlm_tokenizer(texts, None, 320)
    assert vision.convert_ids_to_tokens(2) == IMAGE_PLACEHOLDER == vision.image_token and vision.model_max_length == 1024
    assert vision("USER: <image>\nx").input_ids.count(2) == 1  # the placeholder is one special token
