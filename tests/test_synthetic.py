"""Synthetic pairs (`specdec synth-pair`) and the what-if study (`specdec bench --synthetic`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.models import synthetic
from specdec.models.synthetic import (
    CALIBRATION,
    DTYPES,
    DraftSpec,
    TargetSpec,
    build_draft,
    cached_draft,
    cached_target,
    check_memory,
    critical_noise,
    estimate_memory,
    gaussian_rows,
    load_shape,
    measure_full,
    meta_model,
    noise_for_agreement,
    plan_tensors,
    read_record,
    shape_names,
    synth_pair,
    target_config,
    write_model,
)
from specdec.sampling import SamplingParams

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 2,
}
"""a tiny Llama config.json (GQA, tied embeddings and an EOS in the original, as real checkpoints have)"""


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shape") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="session")
def synth_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synth-cache")


@pytest.fixture(scope="session")
def tiny_root(tiny_config, synth_cache) -> Path:
    """A float32 synthetic target of the tiny shape, in the cache the what-if test reuses."""
    return cached_target(TargetSpec(shape=str(tiny_config), dtype="float32"), synth_cache, device="cpu")


def _draft(root: Path, agreement: float, layers: int = 1) -> Path:
    folder, _ = cached_draft(root, DraftSpec(agreement=agreement, draft_layers=layers), device="cpu")
    return folder


def _load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ----- shapes ----------------------------------------------------------------------------------

REAL_PARAMS = {"llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512}
"""published parameter counts of the untied originals: the synthetic target must have the same"""
DIMS = {  # hidden, layers, query heads, key-value heads, intermediate, vocabulary
    "llama-3-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256),
    "llama-3.2-3b": (3072, 28, 24, 8, 8192, 128256),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064),
    "mistral-7b": (4096, 32, 32, 8, 14336, 32000),
}


def test_named_shapes_have_the_real_dimensions():
    assert set(DIMS) | {"tiny-llama"} <= set(shape_names())
    for name, dims in DIMS.items():
        config, notes = target_config(load_shape(name), "bfloat16")
        got = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size)
        assert got == dims, name
        assert config.tie_word_embeddings is False and config.eos_token_id is None, name
        model = meta_model(config)  # no memory: every tensor on the meta device
        params = sum(t.numel() for t in model.state_dict().values())
        if name in REAL_PARAMS:
            assert params == REAL_PARAMS[name], name
        plans, head = plan_tensors(model)
        zeroed = [p.name for p in plans if p.kind == "zero" and p.name.endswith("proj.weight")]
        assert len(zeroed) == 2 * (config.num_hidden_layers - 1), name  # o_proj and down_proj of every layer but the first
        assert not any(".layers.0." in n for n in zeroed) and head == "lm_head.weight", name
    mistral, notes = target_config(load_shape("mistral-7b"), "bfloat16")
    assert mistral.sliding_window is None and any("sliding window 4096" in n for n in notes)
    assert load_shape("llama-3.2-1b").config["rope_scaling"]["rope_type"] == "llama3"


def test_unknown_architecture_pieces_are_refused(tmp_path):
    with pytest.raises(SpecDecError, match="neither a named shape"):
        load_shape("llama-9b")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SpecDecError, match="model_type"):
        load_shape(str(bad))


# ----- weights ---------------------------------------------------------------------------------


def test_gaussian_rows_any_range_is_the_same_tensor(monkeypatch):
    monkeypatch.setattr(synthetic, "CHUNK_VALUES", 3 * 8)  # blocks of 3 rows of 8: ranges cross block edges
    whole = gaussian_rows(5, "w", (10, 8), 0.02, 0, 10)
    assert whole.shape == (10, 8) and abs(float(whole.std()) - 0.02) < 0.01
    for a, b in ((0, 1), (2, 7), (4, 10), (9, 10)):
        assert torch.equal(gaussian_rows(5, "w", (10, 8), 0.02, a, b), whole[a:b])
    assert not torch.equal(gaussian_rows(6, "w", (10, 8), 0.02, 0, 10), whole)  # another seed
    assert not torch.equal(gaussian_rows(5, "w2", (10, 8), 0.02, 0, 10), whole)  # another tensor


def test_sharded_model_folder_loads(tmp_path):
    config, _ = target_config(_tiny_shape(), "float32")
    plans, _ = plan_tensors(meta_model(config))
    tensors = {p.name: torch.randn(p.shape) for p in plans}
    params = write_model(tmp_path / "m", config, iter(tensors.items()), config.vocab_size, shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and params == sum(t.numel() for t in tensors.values())
    loaded = _load(tmp_path / "m").state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == config.vocab_size
    assert tokenizer("t17 t511 t1")["input_ids"] == [17, 511, 1] and tokenizer.decode([17, 511]) == "t17 t511"


def _tiny_shape():
    return synthetic.Shape(name="tiny", config=dict(TINY))


# ----- calibration -----------------------------------------------------------------------------


def test_critical_noise_matches_brute_force():
    """σ* per position against the direct definition: the agreement at σ is the share of σ* > σ."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(200, 16, generator=gen)
    clean, noise = torch.randn(40, 16, generator=gen), torch.randn(40, 16, generator=gen)
    target = (hidden @ clean.T).argmax(-1)
    crit = critical_noise(hidden, target, lambda a, b: clean[a:b], lambda a, b: noise[a:b], 40, 7)  # blocks of 7 rows
    for sigma in (0.0, 0.05, 0.2, 0.5, 1.0, 3.0):
        direct = ((hidden @ (clean + sigma * noise).T).argmax(-1) == target).float().mean().item()
        assert (crit > sigma).float().mean().item() == pytest.approx(direct, abs=1 / 200 + 1e-9), sigma
    sigma, share = noise_for_agreement(crit, 0.7)
    assert share == pytest.approx(0.7, abs=0.01)
    assert ((hidden @ (clean + sigma * noise).T).argmax(-1) == target).float().mean().item() == pytest.approx(share, abs=0.01)


def test_noise_for_agreement_worked_example():
    sigma, share = noise_for_agreement(torch.tensor([0.1, 0.2, 0.4, math.inf]), 0.5)
    assert sigma == pytest.approx(math.sqrt(0.2 * 0.4)) and share == 0.5
    assert noise_for_agreement(torch.tensor([0.1, 0.2]), 1.0) == (0.0, 1.0)


@pytest.mark.parametrize("agreement", [0.6, 0.9])
def test_achieved_agreement_is_the_requested_one(tiny_root, agreement):
    """Measured here independently of the module: the saved target decodes new random prompts
    greedily, and the saved draft's argmax is compared with the target's at every decode position."""
    draft_dir = _draft(tiny_root, agreement)
    entry = read_record(tiny_root).drafts[draft_dir.name]
    assert abs(entry.agreement_achieved - agreement) <= 0.05 and entry.measured_with == "full models"
    target, draft = _load(tiny_root / "target"), _load(draft_dir)
    prompts = torch.randint(1, TINY["vocab_size"], (24, 32), generator=torch.Generator().manual_seed(123))
    with torch.inference_mode():
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=0)
        t_arg = target(seqs).logits[:, 31:-1].argmax(-1)
        d_arg = draft(seqs).logits[:, 31:-1].argmax(-1)
    measured = (t_arg == d_arg).float().mean().item()
    assert abs(measured - agreement) <= 0.05, measured


def test_cheap_measurement_equals_running_the_models(tiny_root, monkeypatch):
    """The method used for big targets (first-layer hidden states + the two heads, no forward of
    the target) gives the agreement that running the saved target and draft whole gives."""
    monkeypatch.setattr(synthetic, "FULL_CHECK_MAX_PARAMS", 0)
    entry = build_draft(tiny_root, DraftSpec(agreement=0.7), "draft-cheap", device="cpu")
    assert entry.measured_with == "first layer + heads"
    calib = load_file(str(tiny_root / synthetic.CALIBRATION_FILE))
    full = measure_full(tiny_root / "target", tiny_root / "draft-cheap", calib["check_ids"], read_record(tiny_root).target.prompt_tokens, torch.device("cpu"))
    assert full.positions == entry.check_positions
    assert abs(full.agreement - entry.agreement_achieved) <= 0.005 and abs(entry.agreement_achieved - 0.7) <= 0.05
    assert full.draft_top1 == pytest.approx(entry.draft_top1, abs=0.005)


def test_target_computes_its_first_layer(tiny_root):
    """The target equals the noiseless draft (its first layer, embeddings, norm and head) on any input,
    and only the output projections of its later layers are zero."""
    exact = _draft(tiny_root, 1.0, layers=2)
    assert read_record(tiny_root).drafts[exact.name].agreement_achieved == 1.0
    target, draft = _load(tiny_root / "target"), _load(exact)
    ids = torch.randint(1, TINY["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        assert torch.allclose(target(ids).logits, draft(ids).logits, atol=1e-4)
    weights = target.state_dict()
    for layer in range(TINY["num_hidden_layers"]):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            zero = not weights[f"model.layers.{layer}.{name}.weight"].any()
            assert zero == (layer > 0), (layer, name)
    assert weights["model.layers.1.self_attn.q_proj.weight"].any()  # later layers still cost a full forward


def test_pair_record_prompts_and_tokenizer(tiny_root):
    record = read_record(tiny_root)
    assert record is not None and record.target.dims["num_hidden_layers"] == 3 and record.target.head_scale_auto
    assert 0.6 < record.target.target_top1 < 0.9  # auto head scale: mean top-1 probability about 0.75
    assert any("untied" in n for n in record.target.notes) and any("EOS" in n for n in record.target.notes)
    tokenizer = AutoTokenizer.from_pretrained(tiny_root / "target")
    assert len(tokenizer) == TINY["vocab_size"]
    lines = [json.loads(line) for line in (tiny_root / "prompts.jsonl").read_text().splitlines()]
    ids = tokenizer(lines[0]["prompt"])["input_ids"]
    assert len(ids) == record.target.prompt_tokens and 0 not in ids


@pytest.mark.parametrize("method", ["chain", "eagle2"])
def test_greedy_speculative_output_equals_generate(tiny_root, method):
    target = _load(tiny_root / "target")
    tokenizer = AutoTokenizer.from_pretrained(tiny_root / "target")
    decoder = SpeculativeDecoder(target, tokenizer, _load(_draft(tiny_root, 0.6)), method=method)
    prompts = [json.loads(line)["prompt"] for line in (tiny_root / "prompts.jsonl").read_text().splitlines()[:3]]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    outs = decoder.generate_ids(ids, 40, SamplingParams(), batch_size=2)
    accepted = 0
    for prompt_ids, out in zip(ids, outs, strict=True):
        x = torch.tensor([prompt_ids])
        with torch.inference_mode():
            ref = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False, pad_token_id=0)[0, x.shape[1] :]
        assert out.token_ids == ref.tolist()
        accepted += out.stats.accepted_tokens
    assert accepted > 0  # the draft was used, not bypassed


# ----- command line ----------------------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_synth_pair_cli_builds_a_pair(capsys, tiny_config, tmp_path):
    out = tmp_path / "pair"
    code, stdout, _ = _run(capsys, "synth-pair", "--shape", str(tiny_config), "--agreement", "0.8", "--dtype", "float32", "--seed", "3", "--device", "cpu", "--out", str(out))
    assert code == 0 and "achieved" in stdout
    data = json.loads((out / "synth_pair.json").read_text())
    draft = data["drafts"]["draft"]
    assert data["target"]["seed"] == 3 and draft["agreement_requested"] == 0.8 and abs(draft["agreement_achieved"] - 0.8) <= 0.05
    assert (out / "target" / "config.json").is_file() and (out / "draft" / "model.safetensors").is_file()
    code, stdout, _ = _run(capsys, "generate", "--target", str(out / "target"), "--draft", str(out / "draft"), "--prompt", "t5 t9 t300", "--max-new-tokens", "8", "--json")
    assert code == 0 and len(json.loads(stdout)["token_ids"]) == 8  # no EOS: the budget is used up


BAD_SYNTH = {
    "agreement above one": (["--agreement", "1.5"], "--agreement 1.5 must be in (0, 1]"),
    "agreement zero": (["--agreement", "0"], "--agreement 0.0 must be in (0, 1]"),
    "agreement not a number": (["--agreement", "most"], "--agreement 'most' is not a number"),
    "draft layers zero": (["--draft-layers", "0"], "--draft-layers 0 must be a positive integer"),
    "draft as deep as the target": (["--draft-layers", "3"], "--draft-layers 3 must be below the target's 3 layers"),
    "dtype": (["--dtype", "float8"], "--dtype 'float8' is not supported"),
    "seed": (["--seed", "-1"], "--seed -1 must be at least 0"),
    "head scale": (["--head-scale", "-2"], "--head-scale '-2' must be 'auto' or a positive number"),
    "prompt tokens over the context": (["--prompt-tokens", "500"], "exceed the shape's 512 positions"),
    "unknown shape": (["--shape", "llama-9b"], "--shape 'llama-9b' is neither a named shape"),
}


@pytest.mark.parametrize("case", list(BAD_SYNTH))
def test_synth_pair_bad_options_exit_2(capsys, tiny_config, tmp_path, case):
    extra, needle = BAD_SYNTH[case]
    argv = ["synth-pair", "--shape", str(tiny_config), "--out", str(tmp_path / "o"), "--device", "cpu", *extra]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # refused before building anything (or creating --out)


def test_synth_pair_refuses_a_non_empty_out(capsys, tiny_config, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("x")
    code, _, err = _run(capsys, "synth-pair", "--shape", str(tiny_config), "--out", str(tmp_path / "o"))
    assert code == 2 and "is not an empty folder" in err
    code, _, err = _run(capsys, "synth-pair", "--out", str(tmp_path / "p"))
    assert code == 2 and "--shape is required" in err


BAD_SHAPES = {
    "heads do not divide hidden": (
        {**TINY, "num_attention_heads": 7},
        "is not a valid llama config: The hidden size (64) is not a multiple of the number of attention heads (7); fix the file",
    ),
    "a field of the wrong type": ({**TINY, "hidden_size": "64"}, "is not a valid llama config: Field 'hidden_size' expected int, got str"),
    "unknown model type": ({**TINY, "model_type": "llama9"}, "model_type 'llama9' is not one transformers knows"),
    "an encoder": (
        {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 512},
        "is an encoder (bert, a masked LM that reads both ways), not a causal LM",
    ),
    "an encoder-decoder": (
        {"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 2, "vocab_size": 512},
        "is an encoder-decoder model (t5), not a causal LM",
    ),
}
"""config.json files transformers refuses to build, or builds but not as a decoder-only causal LM"""


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_bad_shape_files_are_one_line_errors(capsys, tmp_path, case):
    """Refused up front, by synth-pair and by bench --synthetic, naming the file and the reason, with
    no traceback, before anything is built (an encoder used to be calibrated first and then refused
    for a wrong reason, soft-capping)."""
    config, needle = BAD_SHAPES[case]
    shape = tmp_path / "bad.json"
    shape.write_text(json.dumps(config))
    code, _, err = _run(capsys, "synth-pair", "--shape", str(shape), "--device", "cpu", "--out", str(tmp_path / "o"))
    assert code == 2 and needle in err and f"--shape {str(shape)!r}" in err, err
    assert err.startswith("specdec: error: ") and len(err.strip().splitlines()) == 1  # no traceback, no "generating ..." line
    assert not (tmp_path / "o").exists()
    code, _, err = _run(capsys, "bench", "--synthetic", str(shape), "--synth-cache", str(tmp_path / "c"), "--no-progress", "--out", str(tmp_path / "b"))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "c").exists()


HUGE = {**TINY, "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 100, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000}
"""~6.1e12 parameters (~333 GB to build): far beyond any machine's memory"""


def _estimate(shape: str, dtype: str = "float16", device: str = "cpu"):
    config, _ = target_config(load_shape(shape), dtype)
    plans, _ = plan_tensors(meta_model(config))
    return estimate_memory(config, plans, DTYPES[dtype], 64, CALIBRATION, 1, torch.device(device))


def test_memory_estimate_of_the_documented_shapes():
    """The estimate follows what the build allocates: docs/synthetic-pairs.md measured a peak RSS of
    8.8 GiB for llama-3-8b in float16 and 1.2 GiB for tiny-llama (both including ~0.4 GiB of Python
    and torch), so every named shape passes the check on the 23 GB machine they were built on."""
    gib = 2**30
    eight = _estimate("llama-3-8b")
    assert eight.target_params == REAL_PARAMS["llama-3-8b"] and eight.draft_params == 1_268_789_248  # docs: 1,268.8M
    assert 7.5 * gib < eight.host_bytes < 9.5 * gib and "calibrating" in eight.host_phase and eight.device_bytes == 0
    assert 0.5 * gib < _estimate("tiny-llama", "float32").host_bytes < 1.3 * gib
    for name in shape_names():
        assert _estimate(name).host_bytes < 12e9, name  # leaves room on a 16 GB machine too


def test_a_shape_too_big_for_memory_is_refused_before_anything_is_created(capsys, tmp_path, monkeypatch, tiny_config):
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(HUGE))
    monkeypatch.setattr(synthetic, "available_memory", lambda: 64 * 10**9)
    out = tmp_path / "new" / "pair"
    code, _, err = _run(capsys, "synth-pair", "--shape", str(huge), "--device", "cpu", "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--shape {str(huge)!r} is too big for this machine" in err and "6,124.54B-parameter target" in err
    assert "GB of memory" in err and "64.0 GB is available" in err and "smaller shape" in err and "more memory" in err
    assert not (tmp_path / "new").exists()  # neither --out nor its parent was created
    # the check compares with what is available: the tiny shape fits in 2 GB, not in 100 MB
    monkeypatch.setattr(synthetic, "available_memory", lambda: 10**8)
    code, _, err = _run(capsys, "synth-pair", "--shape", str(tiny_config), "--device", "cpu", "--out", str(out))
    assert code == 2 and "is too big for this machine" in err and "0.1 GB is available" in err, err
    assert not (tmp_path / "new").exists()
    code, _, err = _run(capsys, "bench", "--synthetic", str(huge), "--synth-cache", str(tmp_path / "c"), "--no-progress", "--out", str(tmp_path / "b"))
    assert code == 2 and "is too big for this machine" in err, err
    assert not (tmp_path / "c").exists()
    # on CUDA the calibration's share is compared with the GPU's free memory
    monkeypatch.setattr(synthetic, "available_memory", lambda: 64 * 10**9)
    monkeypatch.setattr(synthetic, "available_device_memory", lambda device: 10**8)
    estimate = _estimate("tiny-llama", "float32", "cuda")
    assert estimate.device_bytes > 10**8 and "calibrating" in estimate.device_phase
    with pytest.raises(SpecDecError, match=r"too big for cuda: .* of GPU memory .* 0\.1 GB is free; .* or --device cpu"):
        check_memory(load_shape("tiny-llama"), estimate, torch.device("cuda"))
    monkeypatch.setattr(synthetic, "available_memory", lambda: None)  # unknown: no check
    check_memory(load_shape(str(huge)), _estimate(str(huge)), torch.device("cpu"))


def test_a_failed_build_leaves_no_folder_behind(tmp_path, monkeypatch, tiny_config):
    def fail(*args, **kwargs):
        raise SpecDecError("the draft failed")

    monkeypatch.setattr(synthetic, "build_draft", fail)
    spec, draft = TargetSpec(shape=str(tiny_config), dtype="float32"), DraftSpec(agreement=0.8)
    with pytest.raises(SpecDecError, match="the draft failed"):
        synth_pair(spec, draft, tmp_path / "new" / "pair", device="cpu")
    assert not (tmp_path / "new").exists()  # the folders it created are removed
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecError, match="the draft failed"):
        synth_pair(spec, draft, tmp_path / "empty", device="cpu")
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())  # a given empty folder is left as it was


def test_build_draft_needs_a_target(tmp_path):
    with pytest.raises(SpecDecError, match="holds no synthetic target"):
        build_draft(tmp_path, DraftSpec(agreement=0.5))


BAD_WHATIF = {
    "agreement out of range": (["--synthetic", "tiny-llama", "--agreements", "0.5,1.2"], "--agreements: 1.2 must be in (0, 1]"),
    "agreements without synthetic": (["--agreements", "0.5"], "--agreements, --synth-cache only apply with --synthetic"),
    "target with synthetic": (["--synthetic", "tiny-llama", "--target", "x"], "--target does not go with --synthetic"),
    "text prompts": (["--synthetic", "tiny-llama", "--prompts", "stdlib-heldout"], "--prompts stdlib-heldout is text"),
    "draft layers": (["--synthetic", "tiny-llama", "--draft-layers", "8"], "--draft-layers 8 must be below the target's 8 layers"),
    "empty shape": (["--synthetic", ""], "--synthetic is empty; give a named shape"),
    "unknown shape": (["--synthetic", "llama-9b"], "--synthetic 'llama-9b' is neither a named shape"),
}


@pytest.mark.parametrize("case", list(BAD_WHATIF))
def test_whatif_bad_options_exit_2(capsys, tmp_path, case):
    extra, needle = BAD_WHATIF[case]
    code, _, err = _run(capsys, "bench", "--out", str(tmp_path / "o"), "--synth-cache", str(tmp_path / "c"), "--no-progress", *extra)
    assert code == 2 and needle in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "c").exists()  # refused before building anything


def test_whatif_end_to_end(capsys, tiny_config, tiny_root, synth_cache, tmp_path):
    """Two agreements on the tiny shape: the pairs come from the cache (the target the other tests
    built), every method runs against AR and the HF peers, and the study's files are written."""
    stamp = (tiny_root / "target" / "model.safetensors").stat().st_mtime_ns
    out = tmp_path / "whatif"
    code, stdout, _ = _run(
        capsys, "bench", "--synthetic", str(tiny_config), "--agreements", "0.9,0.6", "--synth-cache", str(synth_cache), "--device", "cpu",
        "--methods", "ar,hf,hf-assisted,chain,dynatree", "--num-prompts", "2", "--repeats", "1", "--max-new-tokens", "24", "--no-progress",
        "--out", str(out),
    )
    assert code == 0 and "agreement 0.6" in stdout
    assert (tiny_root / "target" / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    results = json.loads((out / "results.json").read_text())
    assert [a["requested"] for a in results["agreements"]] == [0.6, 0.9]  # sorted
    for entry in results["agreements"]:
        assert abs(entry["draft"]["agreement_achieved"] - entry["requested"]) <= 0.05
        assert set(entry["methods"]) == {"ar", "hf", "hf-assisted", "chain", "dynatree"}
        assert all(m["matches_ar"] for m in entry["methods"].values())
        assert 0 <= entry["chain_first_token_acceptance"] <= 1
        assert (out / f"agreement-{entry['requested']:g}" / "report.md").is_file()
    taus = [entry["methods"]["chain"]["tau"] for entry in results["agreements"]]
    assert taus[1] > taus[0]  # a better draft gets more tokens accepted per step
    assert (out / "speedup_vs_agreement.png").read_bytes()[:8] == PNG_MAGIC
    report = (out / "report.md").read_text()
    assert "## Speedup over AR" in report and "| hf-assisted |" in report and "meaningless" in report and "No GPU was measured" in report
