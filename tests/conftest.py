"""Shared fixtures: tiny randomly initialised models of several architectures, and a tiny
saved target/draft pair with a trained tokenizer (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, LlavaForConditionalGeneration, Qwen2Config

from specdec import extras
from specdec.multimodal.inputs import encode_multimodal
from specdec.training.lvlm import LvlmSize, lvlm_config, make_processor, train_lvlm_tokenizer

torch.set_num_threads(1)

needs_serve = pytest.mark.skipif(bool(extras.missing(*extras.EXTRAS["serve"])), reason="needs the serve extra (fastapi, uvicorn, pydantic)")
"""for tests that start `specdec serve` (the GPU machine's image has no fastapi)"""

VOCAB = 96
EOS = 2
ARCHS = ("llama", "gpt_neox", "gpt2", "qwen2")


@pytest.fixture(autouse=True)
def measured_cost_cache(tmp_path_factory, monkeypatch):
    """Each test keeps the cost profiles it measures in its own empty folder (never the user's
    ~/.cache, and never one an earlier test filled)."""
    folder = tmp_path_factory.mktemp("specdec-cache")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(folder))
    return folder / "cost-profiles"


def tiny_config(arch: str, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, eos: int = EOS, max_pos: int = 256):
    """A tiny config of `arch` (random weights come from the seed set before from_config)."""
    common = {"vocab_size": vocab, "eos_token_id": eos, "bos_token_id": 1, "pad_token_id": 0}
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=max_pos, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_pos, tie_word_embeddings=False, **common)  # see tiny_any_config
    raise ValueError(arch)


MORE_ARCHS = ("mistral", "gemma2", "gemma3_text", "phi3", "opt", "falcon", "gptj", "qwen3_moe", "gpt_oss", "olmo3", "cohere2", "starcoder2", "deepseek_v3", "gemma3n_text")
"""more transformers architectures, built by `tiny_any_config`: sliding windows (every layer or mixed,
a window of 8 so the prompts and generations cross it), soft-capped logits, mixture-of-experts
layers, learned and partial rotary positions, multi-head latent attention (DeepSeek-V3: a compressed
cache whose keys and values differ in shape), layers reusing earlier layers' keys and values
(Gemma 3n's KV sharing)"""

WIDE_ARCHS = (
    "phi", "qwen3", "granite", "stablelm", "smollm3", "glm", "glm4", "exaone4", "ernie4_5", "hunyuan_v1_dense", "seed_oss",
    "olmo2", "olmoe", "mixtral", "deepseek_v2", "nemotron", "gemma", "persimmon", "codegen", "xglm", "biogpt",
    "ministral", "apertus", "arcee", "helium", "bitnet", "gpt_bigcode", "cohere", "phimoe", "granitemoe", "qwen2_moe",
    "minicpm3", "glm4_moe_lite", "longcat_flash", "youtu", "sarvam_mla", "axk1",
    # the architecture sweep's 48 (benchmarks/architecture-sweep/decoded.log)
    "afmoe", "apertus1p5_text", "aria_text", "beam", "bert-generation", "cohere2_moe", "ctrl", "cwm", "diffllama", "doge",
    "ernie4_5_moe", "exaone", "exaone_moe", "flex_olmo", "flint", "fuyu", "gemma4_text", "gemma4_unified_text", "git",
    "glm4_moe", "gpt-sw3", "gpt_neox_japanese", "granite_swa", "granitemoe_swa", "granitemoeshared", "hrm_text",
    "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna", "lfm2",
    "mellum", "mimo_v2_flash", "minimax_m2", "minimax_m3_vl_text", "ministral3", "modernbert-decoder", "moshi", "nanochat",
    "olmo", "sarvam_moe", "solar_open", "vaultgemma",
)
"""every other transformers causal LM `tiny_any_config` builds and `generate()` runs; the opt-in
sweep of every method over them (`SPECDEC_WIDE_ARCHS=1`, tests/test_architectures.py)"""



LATENT_ATTENTION_ARCHS = ("deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "longcat_flash", "youtu", "sarvam_mla", "axk1")
"""architectures with DeepSeek's multi-head latent attention (a compressed cache), given its sizes by `tiny_any_config`"""


def tiny_any_config(model_type: str, layers: int = 2, hidden: int = 64, vocab: int = VOCAB, **overrides):
    """A tiny config of any transformers causal LM type, from its defaults with small sizes."""
    from transformers import AutoConfig

    fields = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4, "max_position_embeddings": 256,
        "eos_token_id": EOS, "bos_token_id": 1, "pad_token_id": 0,
        "tie_word_embeddings": False,  # tied, `sharpen`'s scaled output layer scales the input embeddings too: the model echoes its last token
    }
    if model_type == "falcon":
        fields.pop("head_dim")  # a property of Falcon's config
    if model_type in ("gptj", "codegen"):
        fields["rotary_dim"] = hidden // 8
    if model_type in ("qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral"):
        fields.update(num_experts=4, num_local_experts=4, num_experts_per_tok=2)
    if model_type in LATENT_ATTENTION_ARCHS:  # latent attention: the cache keeps a 16-wide latent (keys) and the 8-wide rotary key (values)
        fields.update(
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, moe_intermediate_size=32,
        )
    if model_type == "gemma3n_text":  # four layers, the last two reusing the first two's keys and values (KV sharing)
        fields.update(
            num_hidden_layers=4, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2, altup_num_inputs=2, laurel_rank=8,
            hidden_size_per_layer_input=8, activation_sparsity_pattern=[0.0] * 4, intermediate_size=[2 * hidden] * 4,
        )
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    for name, value in (("n_embd", hidden), ("n_layer", layers), ("n_head", 4), ("n_positions", 256)):
        if hasattr(config, name) and name not in fields:
            setattr(config, name, value)
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = 8
    return config


def tiny_model(arch: str, seed: int, **kwargs):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs)).eval()


def sharpen(model, scale: float = 6.0):
    """Scale the output layer so the random model has peaked (less tie-prone) distributions."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


def close_pair(arch: str):
    """A sharpened tiny target and a draft with the same weights plus noise: often agrees, sometimes not."""
    target = sharpen(tiny_model(arch, seed=0))
    draft = sharpen(tiny_model(arch, seed=0))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return target, draft


def cast_level_options() -> dict[str, object]:
    """CAST's options in the level-capture tests: deterministic (its plans do not follow wall-clock
    times, so captured and op-by-op runs plan alike) on a GPU-like synthetic table (verification
    nearly flat in n, a cheap draft: trees of several layers of changing widths)."""
    from specdec.cost import CostTable

    table = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 0.2 + 0.01 * b * n)
    return {"cost_table": table, "plain_steps": False, "deterministic": True, "top_k": 4, "total_tokens": 24}


def decode_in_session(engine, prompts: list[list[int]], budgets: list[int], max_rows: int) -> tuple[list[list[int]], list[int]]:
    """Decode `prompts` (each with its token budget) in one rolling-batch session of `engine` with
    `max_rows` rows; returns each prompt's tokens and the batch size of every step (riders included)."""
    session = engine.session(max_rows=max_rows, keep_steps=True)
    requests = [session.submit(p, n) for p, n in zip(prompts, budgets, strict=True)]
    sizes = []
    while session.unfinished:
        record = session.step()
        if record is not None:
            sizes.append(len(record.active))
    assert not session.rows  # every row left at the end
    return [r.token_ids for r in requests], sizes


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory) -> Path:
    """A saved GPT-NeoX target/draft pair with a small trained BPE tokenizer: dir/target, dir/draft."""
    from specdec.training.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("pair")
    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n", "class A:\n    pass\n"] * 50
    tok = train_tokenizer(text, root / "tokenizer", vocab_size=300, min_frequency=1)
    vocab = len(tok)
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        torch.manual_seed(seed)
        cfg = tiny_config("gpt_neox", layers=layers, vocab=vocab, eos=tok.eos_token_id)
        cfg.pad_token_id = tok.pad_token_id
        model = sharpen(AutoModelForCausalLM.from_config(cfg).eval())
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def cli_args(command: str, pair: Path, prompts: Path, out: Path, max_new_tokens: int, repeats: int, *extra: str) -> list[str]:
    """`specdec bench`/`sweep` arguments for the tiny pair on CPU, quiet."""
    return [
        command, "--prompts", str(prompts), "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--device", "cpu",
        "--max-new-tokens", str(max_new_tokens), "--repeats", str(repeats), "--no-progress", "--out", str(out), *extra,
    ]


# ----- a tiny random LLaVA pair ----------------------------------------------------------
LVLM_TEXTS = [
    "USER: <image>\nWhat is in the picture? ASSISTANT:",
    "USER: <image>\n<image>\nWhat changed between the two images? ASSISTANT:",
    "USER: What is two plus three? ASSISTANT:",
]
SIZE_T = LvlmSize(vision_hidden=32, vision_layers=1, vision_heads=2, text_hidden=32, text_layers=2, text_heads=2, image_size=32, patch_size=8)
SIZE_D = LvlmSize(vision_hidden=16, vision_layers=1, vision_heads=2, text_hidden=32, text_layers=1, text_heads=2, image_size=32, patch_size=8)


def lvlm_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))


def _sharpen(model, scale: float = 8.0):
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="session")
def lvlm(tmp_path_factory):
    """A tiny random LLaVA target and draft saved with tokenizer and processor."""
    texts = [t + " There is a red circle at the top left.</s>" for t in LVLM_TEXTS] * 40
    tok = train_lvlm_tokenizer(texts, vocab_size=300)
    root = tmp_path_factory.mktemp("lvlm")
    models = {}
    for name, size, seed in (("target", SIZE_T, 0), ("draft", SIZE_D, 1)):
        torch.manual_seed(seed)
        cfg = lvlm_config(size, tok)
        cfg.tie_word_embeddings = False
        cfg.text_config.tie_word_embeddings = False
        model = _sharpen(LlavaForConditionalGeneration(cfg).eval())
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        make_processor(tok, size).save_pretrained(root / name)
        models[name] = model
    processor = make_processor(tok, SIZE_T)
    prompts = [
        encode_multimodal(processor, LVLM_TEXTS[0], [lvlm_image(0)]),
        encode_multimodal(processor, LVLM_TEXTS[1], [lvlm_image(1), lvlm_image(2)]),
        tok(LVLM_TEXTS[2])["input_ids"],
        encode_multimodal(processor, LVLM_TEXTS[0], [lvlm_image(3)]),
    ]
    return {"root": root, "tok": tok, "processor": processor, "prompts": prompts, **models}


