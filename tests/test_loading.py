"""Loading models the way users bring them (specdec/models/loading.py, the API's keywords and
the CLI's flags), on what a CPU can run:

- wrong models are refused with a short message: an encoder (BERT), an encoder-decoder (T5),
  a checkpoint without its LM head or with missing / unexpected / corrupt weights (tied
  embeddings are not missing), a folder without config.json or without tokenizer files;
- attn_implementation eager / sdpa load and give the same greedy output; flash attention is
  refused (tree masks);
- revision on a local folder is an error; device_map / quantization need accelerate /
  bitsandbytes (an error naming them when absent) and are passed to from_pretrained, with
  quantized and device-mapped models never moved afterwards; a pre-quantized checkpoint
  loads as it is;
- models already loaded (PreTrainedModel + tokenizer) work in `from_pretrained`.

Not run here (no GPU, no accelerate/bitsandbytes installed): a real device map over several
GPUs, bitsandbytes kernels, a real pre-quantized (GPTQ/AWQ/bnb) checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BitsAndBytesConfig,
    LlamaModel,
    T5Config,
    T5ForConditionalGeneration,
)

from specdec import extras
from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.models.loading import LoadOptions, eos_token_ids, load_model, load_tokenizer

PROMPT = "def add(a, b):"


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def copy_model(src: Path, dst: Path, with_tokenizer: bool = True) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if with_tokenizer or not f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def wrong_models(tiny_pair_dir, tmp_path_factory) -> Path:
    """Saved folders of models that are not (complete) causal LMs, each with the pair's tokenizer."""
    root = tmp_path_factory.mktemp("wrong")
    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": len(tok)}
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**small)).save_pretrained(root / "bert")
    T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=len(tok))).save_pretrained(root / "t5")
    cfg = tiny_config("llama", vocab=len(tok), eos=tok.eos_token_id)
    cfg.tie_word_embeddings = False
    LlamaModel(cfg).save_pretrained(root / "llama-no-head")  # the base model: no lm_head.weight
    cfg_tied = tiny_config("llama", vocab=len(tok), eos=tok.eos_token_id)
    cfg_tied.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(cfg_tied).save_pretrained(root / "llama-tied")  # lm_head tied to the embeddings: nothing missing
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "llama-extra")
    weights = load_file(root / "llama-extra" / "model.safetensors")
    weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, root / "llama-extra" / "model.safetensors", metadata={"format": "pt"})
    for name in ("bert", "t5", "llama-no-head", "llama-tied", "llama-extra"):
        tok.save_pretrained(root / name)
    return root


# ----- wrong models ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,needles",
    [
        ("bert", ["is an encoder (bert", "not a causal LM"]),
        ("t5", ["encoder-decoder model (t5)", "not a causal LM"]),
        ("llama-no-head", ["1 weight(s) missing", "lm_head.weight", "would be random"]),
        ("llama-extra", ["not in the model", "model.layers.9.mlp.up_proj.weight"]),
    ],
)
def test_wrong_model_is_refused_in_one_line(capsys, wrong_models, tiny_pair_dir, name, needles):
    code, err = run_cli(capsys, "generate", "--target", str(wrong_models / name), "--method", "ar", "--prompt", "x", "--device", "cpu")
    assert code == 2, err
    assert all(n in err for n in needles), err
    assert len(err.strip().splitlines()) == 1 and len(err) < 400, err  # one short line, not 100+ class names
    assert "Traceback" not in err


def test_tied_embeddings_are_not_missing(wrong_models):
    model = load_model(str(wrong_models / "llama-tied"), "target", "cpu")
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_missing_weights_name_the_first_few_and_the_count(tmp_path, tiny_pair_dir):
    """Many missing tensors: the first three by name, then the count."""
    target = copy_model(tiny_pair_dir / "target", tmp_path / "t")
    weights = load_file(target / "model.safetensors")
    kept = {k: v for k, v in weights.items() if "layers.1." not in k}
    save_file(kept, target / "model.safetensors", metadata={"format": "pt"})
    dropped = len(weights) - len(kept)
    assert dropped > 3
    with pytest.raises(SpecDecError, match=rf"{dropped} weight\(s\) missing .*, \.\.\. \({dropped} in all\)"):
        load_model(str(target), "target", "cpu")


@pytest.mark.parametrize(
    "edit,needles",
    [
        ({"num_attention_heads": 5}, ["fails transformers' checks", "not divisible by the number of attention heads", "fix config.json"]),
        ({"vocab_size": 9000}, ["and its weights disagree", "embed_in.weight is [", "from config.json", "vocab_size"]),
    ],
)
def test_a_config_that_does_not_fit_its_weights_is_a_clear_error(capsys, tmp_path, tiny_pair_dir, edit, needles):
    """A config.json transformers' own checks reject (heads that do not divide the hidden size),
    or one whose sizes differ from the saved tensors': one line naming the reason (was a
    traceback, and a 'see the report above' with no report)."""
    draft = copy_model(tiny_pair_dir / "draft", tmp_path / "d")
    config = json.loads((draft / "config.json").read_text())
    if "num_attention_heads" in edit:
        assert config["hidden_size"] % 5, "the edit must break divisibility"
    (draft / "config.json").write_text(json.dumps({**config, **edit}))
    code, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(draft), "--prompt", "x", "--device", "cpu")
    assert code == 2, err
    assert all(n in err for n in needles), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_is_a_clear_error(capsys, tmp_path, tiny_pair_dir, damage):
    target = copy_model(tiny_pair_dir / "target", tmp_path / "t")
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 4)
    code, err = run_cli(capsys, "generate", "--target", str(target), "--method", "ar", "--prompt", "x", "--device", "cpu")
    assert code == 2 and "corrupt or truncated" in err and str(target) in err and "Traceback" not in err


def test_folder_without_tokenizer_files(capsys, tmp_path, tiny_pair_dir):
    """Once reported as 'tokenizers differ (2 vs ...)' (draft) or 'the prompt is empty' (target)."""
    bare = copy_model(tiny_pair_dir / "draft", tmp_path / "bare", with_tokenizer=False)
    pair = ["--prompt", "x", "--device", "cpu"]
    code, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(bare), *pair)
    assert code == 2 and "draft model folder" in err and "has no tokenizer files" in err and "differ" not in err
    code, err = run_cli(capsys, "generate", "--target", str(bare), "--method", "ar", *pair)
    assert code == 2 and "has no tokenizer files" in err and "prompt is empty" not in err


def test_tokenizer_of_special_tokens_only_is_refused(tmp_path, tiny_pair_dir):
    """A tokenizer_config.json without the vocabulary: transformers builds a 2-token tokenizer."""
    bare = copy_model(tiny_pair_dir / "draft", tmp_path / "bare", with_tokenizer=False)
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTNeoXTokenizer", "eos_token": "<|endoftext|>"}))
    with pytest.raises(SpecDecError, match="holds only its 2 special tokens"):
        load_tokenizer(str(bare), "draft")


def test_empty_folder_and_file_paths(capsys, tmp_path, tiny_pair_dir):
    (tmp_path / "empty").mkdir()
    code, err = run_cli(capsys, "generate", "--target", str(tmp_path / "empty"), "--method", "ar", "--prompt", "x")
    assert code == 2 and "has no config.json" in err and "sentencepiece" not in err
    code, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dir / "target" / "config.json"), "--method", "ar", "--prompt", "x")
    assert code == 2 and "is a file" in err


def test_draft_tokenizer_with_another_eos_token_is_accepted(tmp_path, tiny_pair_dir):
    """Same vocabulary, another EOS token (an instruct target, a base draft): the target's EOS decides."""
    draft = copy_model(tiny_pair_dir / "draft", tmp_path / "d")
    config = json.loads((draft / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|pad|>"
    (draft / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(draft)).eos_token_id != load_tokenizer(str(tiny_pair_dir / "target")).eos_token_id
    decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(draft), device="cpu")
    reference = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), method="ar", device="cpu")
    assert decoder.generate(PROMPT, max_new_tokens=12).token_ids == reference.generate(PROMPT, max_new_tokens=12).token_ids


# ----- loading options ---------------------------------------------------------------------
def test_attn_implementation_eager_and_sdpa(tiny_pair_dir):
    outputs = {}
    for attn in ("eager", "sdpa"):
        decoder = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu", attn_implementation=attn)
        assert decoder.target.config._attn_implementation == attn and decoder.draft.config._attn_implementation == attn
        outputs[attn] = decoder.generate(PROMPT, max_new_tokens=12).token_ids
    assert outputs["eager"] == outputs["sdpa"]


def test_flash_attention_and_bad_options_are_refused(capsys, tiny_pair_dir):
    pair = ["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--prompt", "x"]
    for extra, needle in (
        (["--attn-implementation", "flash_attention_2"], "4D attention masks"),
        (["--quantization", "3bit"], "quantization='3bit'"),
        (["--device-map", "everywhere"], "device_map='everywhere'"),
        (["--device", "cpu", "--device-map", "auto"], "not both"),
    ):
        code, err = run_cli(capsys, "generate", *pair, *extra)
        assert code == 2 and needle in err, (extra, err)


def test_revision_on_a_local_folder(capsys, tiny_pair_dir):
    code, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dir / "target"), "--method", "ar", "--revision", "v1.0", "--prompt", "x")
    assert code == 2 and "revision 'v1.0' applies to hub ids" in err and "local folder" in err
    with pytest.raises(SpecDecError, match="revision 'main' applies to hub ids"):
        SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), draft_revision="main")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--device-map", "auto"], "--device-map auto needs accelerate"),
        (["--quantization", "4bit"], "--quantization 4bit needs accelerate and bitsandbytes"),
        (["--draft-quantization", "8bit"], "--draft-quantization 8bit needs accelerate and bitsandbytes"),
    ],
)
def test_missing_accelerate_or_bitsandbytes(capsys, monkeypatch, tiny_pair_dir, extra, needle):
    monkeypatch.setattr(extras, "missing", lambda *names: list(names))  # as on a machine without them
    code, err = run_cli(capsys, "generate", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--prompt", "x", *extra)
    assert code == 2 and needle in err and "pip install" in err, err


class _Captured:
    """A stand-in for AutoModelForCausalLM.from_pretrained: records the keywords, returns the
    real tiny model with empty loading info and makes any later .to() an error."""

    def __init__(self, monkeypatch, folder: Path) -> None:
        self.kwargs: dict = {}
        real = AutoModelForCausalLM.from_pretrained(folder)

        def fake(source, **kwargs):
            self.kwargs = kwargs
            real.to = lambda *a, **k: pytest.fail(f"a placed model was moved: .to({a}, {k})")
            return real, {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}

        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
        monkeypatch.setattr(extras, "missing", lambda *names: [])  # as if accelerate and bitsandbytes were installed


def test_quantization_and_device_map_are_passed_through_and_never_moved(monkeypatch, tiny_pair_dir):
    captured = _Captured(monkeypatch, tiny_pair_dir / "target")
    load_model(str(tiny_pair_dir / "target"), "target", None, "float16", LoadOptions(quantization="4bit"))
    qc = captured.kwargs["quantization_config"]
    assert isinstance(qc, BitsAndBytesConfig) and qc.load_in_4bit and qc.bnb_4bit_compute_dtype == torch.float16
    default = "cuda" if torch.cuda.is_available() else "cpu"  # device None: the default device
    assert captured.kwargs["device_map"] == {"": default}  # quantized, no map: the whole model on the device
    load_model(str(tiny_pair_dir / "target"), "target", None, None, LoadOptions(quantization="8bit", device_map="auto", attn_implementation="sdpa"))
    assert captured.kwargs["quantization_config"].load_in_8bit and captured.kwargs["device_map"] == "auto"
    assert captured.kwargs["attn_implementation"] == "sdpa"
    load_model(str(tiny_pair_dir / "target"), "target", None, None, LoadOptions(device_map={"": "cpu"}, trust_remote_code=True))
    assert "quantization_config" not in captured.kwargs and captured.kwargs["device_map"] == {"": "cpu"}
    assert captured.kwargs["trust_remote_code"] is True


def test_prequantized_checkpoint_loads_as_it_is(monkeypatch, tmp_path, tiny_pair_dir):
    target = copy_model(tiny_pair_dir / "target", tmp_path / "gptq")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecError, match=r"already quantized \(gptq\); drop --quantization 4bit"):
        load_model(str(target), "target", "cpu", None, LoadOptions(quantization="4bit"))
    monkeypatch.setattr(extras, "missing", lambda *names: list(names))
    with pytest.raises(SpecDecError, match="the pre-quantized target checkpoint needs accelerate"):
        load_model(str(target), "target", "cpu")
    captured = _Captured(monkeypatch, tiny_pair_dir / "target")
    load_model(str(target), "target", "cpu")
    assert captured.kwargs["dtype"] == "auto" and captured.kwargs["device_map"] == {"": "cpu"} and "quantization_config" not in captured.kwargs


# ----- models already loaded ---------------------------------------------------------------
def test_already_loaded_models(tiny_pair_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "draft", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    by_path = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="chain", device="cpu")
    expected = by_path.generate(PROMPT, max_new_tokens=12).token_ids
    loaded = SpeculativeDecoder.from_pretrained(target, draft, method="chain", tokenizer=tok)
    assert loaded.target is target and loaded.draft is draft and not target.training
    assert loaded.generate(PROMPT, max_new_tokens=12).token_ids == expected
    mixed = SpeculativeDecoder.from_pretrained(target, str(tiny_pair_dir / "draft"), method="chain", tokenizer=tok)  # draft loaded next to the target
    assert mixed.draft.device == target.device and mixed.generate(PROMPT, max_new_tokens=12).token_ids == expected


def test_already_loaded_models_errors(tiny_pair_dir, wrong_models):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target")
    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    with pytest.raises(SpecDecError, match="needs its tokenizer"):
        SpeculativeDecoder.from_pretrained(target, method="ar")
    with pytest.raises(SpecDecError, match="place and convert the loaded models yourself"):
        SpeculativeDecoder.from_pretrained(target, method="ar", tokenizer=tok, dtype="bfloat16")
    with pytest.raises(SpecDecError, match="got dict"):
        SpeculativeDecoder.from_pretrained({"not": "a model"}, method="ar", tokenizer=tok)
    bert = BertForMaskedLM.from_pretrained(wrong_models / "bert")
    with pytest.raises(SpecDecError, match="is an encoder"):
        SpeculativeDecoder.from_pretrained(target, bert, tokenizer=tok)


def test_tokenizers_differing_only_in_added_tokens_are_accepted(caplog, tiny_pair_dir, tmp_path):
    """Llama 3.0 and 3.1 name their reserved ids differently, and an instruct target adds chat
    tokens its base draft lacks: differences confined to added tokens are a warning naming the
    ids. A regular token moved to another id is still refused."""
    from specdec.models.loading import check_same_tokenizer

    target = load_tokenizer(str(tiny_pair_dir / "target"), "target")
    draft = load_tokenizer(str(tiny_pair_dir / "target"), "draft")
    n = len(target)
    target.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})  # ids n, n + 1
    draft.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>"]})  # id n: another name
    with caplog.at_level("WARNING", logger="specdec.models.loading"):
        check_same_tokenizer(target, draft)
    assert "only in added tokens (2 ids" in caplog.text and f"{n}, {n + 1}" in caplog.text

    swapped = tmp_path / "swapped"  # two regular tokens trade ids
    load_tokenizer(str(tiny_pair_dir / "target"), "draft").save_pretrained(swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (tok for tok, i in vocab.items() if i in (40, 41))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(SpecDecError, match=r"2 regular target tokens missing or mapped to other ids"):
        check_same_tokenizer(load_tokenizer(str(tiny_pair_dir / "target"), "target"), AutoTokenizer.from_pretrained(swapped))


def test_a_regular_token_the_draft_re_adds_elsewhere_is_refused():
    """An entry only one side has is excused only when that side added it: a target's regular
    token that the draft holds as an added token under another id is a regular token moved."""
    from specdec.models.loading import check_same_tokenizer

    class Vocab:  # what the check reads of a tokenizer
        def __init__(self, vocab: dict[str, int], added: dict[str, int]) -> None:
            self.vocab, self.added = vocab, added

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

        def get_added_vocab(self) -> dict[str, int]:
            return self.added

    target = Vocab({"a": 0, "b": 1, "<s>": 2}, {"<s>": 2})
    with pytest.raises(SpecDecError, match="1 regular target tokens missing or mapped to other ids in the draft, 0 the other way, e.g. 'b' = 1"):
        check_same_tokenizer(target, Vocab({"a": 0, "<s>": 2, "b": 3}, {"<s>": 2, "b": 3}))
    check_same_tokenizer(target, Vocab({"a": 0, "b": 1, "<pad>": 2}, {"<pad>": 2}))  # only the added id 2 differs: accepted


def test_eos_ids_the_model_cannot_emit_are_dropped_from_its_configs(caplog):
    """A generation config naming an id past the embedding (or a negative one) would leave rows
    running to their budget; the ids derived from the configs keep only the ones the model can emit."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))  # 96 token ids
    model.generation_config.eos_token_id = [2, 96, -1]
    with caplog.at_level("WARNING", logger="specdec.models.loading"):
        assert eos_token_ids(model, None) == [2]
    assert "[96, -1]" in caplog.text
    model.generation_config.eos_token_id = 5
    assert eos_token_ids(model, None) == [5]
