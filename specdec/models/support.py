"""Which architectures specdec can verify draft trees with, decided from the config (and the
model class when known) before any weights load.

Tree verification forwards many draft tokens at once with explicit position ids and a 4-D
attention mask, then keeps the accepted tokens' key/value slots and drops the rest. That needs
an attention-only key/value cache whose entries can be dropped one by one, and positions that
come from the position ids. Three kinds of model break one of these, and would otherwise crash
mid-generation or, worse, verify against wrong target logits:

- **recurrent or convolutional state** (Mamba, RWKV, xLSTM, Jamba, Falcon-H1, Bamba, MiniMax's
  lightning attention, Qwen3-Next, LFM2's conv layers, ...): every forwarded token updates a
  state that a rejected token cannot be taken back out of;
- **ALiBi biases built from the key's index in the cache or from a 2-D padding mask** (BLOOM,
  MPT, Falcon with `alibi=True`): a tree node's bias would follow its slot, not its depth;
- **attention types with other masks** (Llama 4's chunked attention), and **local windows counted
  in cache slots** (GPT-Neo's local layers, a fixed mask buffer indexed by slot): not built yet.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from transformers import DynamicCache, PretrainedConfig

ATTENTION_CACHE_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer"})
"""transformers cache layers that hold plain per-token keys and values (full or sliding attention),
or nothing at all (`DummyLayer`: a layer reusing an earlier layer's keys and values, as Gemma 3n's
KV-shared layers, or one without attention): no state a rejected token could stay in"""
RECURRENT_LAYER_WORDS = ("LinearAttention", "Mamba", "Conv", "Recurrent", "SSM")
"""words in the names of transformers cache layers that keep a recurrent or convolutional state"""
MASKED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""per-layer attention types whose masks specdec builds (`ModelRunner._sliding_masks`)"""
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
"""architectures whose ALiBi bias comes from the cache index or the 2-D mask, never from position ids"""

SLOT_WINDOW_MODEL_TYPES = frozenset({"gpt_neo"})
"""architectures whose local attention layers mask keys by their distance in cache slots (a fixed
`bias` buffer sliced by the key and query counts), never by position ids: a tree node in slot s
at depth d < s would lose the s - d oldest keys of its window"""

BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3", "paligemma", "shieldgemma2", "molmo2"})
"""vision-language models whose image tokens attend to each other both ways (a block built from
`token_type_ids`, Molmo 2's `mm_token_type_ids`), which specdec's causal 4-D masks would not
reproduce; Gemma 4 does so when its text config says `use_bidirectional_attention="vision"`"""

PREFIX_IMAGE_MODEL_TYPES = frozenset({"git"})
"""vision-language models that put their image embeddings before the prompt's tokens themselves
(no image tokens in the ids) and join a 2-D image mask to the text mask: prompts with images
would crash on specdec's 4-D masks and be positioned without the image (text prompts decode exactly)"""

MODEL_TYPE_PROBLEMS = {
    "kosmos-2": (
        "derives its position ids from the token ids (counting past its padding id) and builds masks only from a 2-D padding "
        "mask, so a draft tree's explicit positions and 4-D mask would be misread"
    ),
    "kosmos-2.5": (
        "derives its position ids from the token ids (counting past its padding id) and reads explicit position ids as already "
        "offset, so every token would be positioned wrong"
    ),
    "idefics": (
        "reads its images through gated cross-attention layers at every forward (each step needs the images again), which "
        "specdec's key/value cache does not hold"
    ),
}
"""model types refused whole, with the reason (found in the image sweep of 2026-11-26,
benchmarks/architecture-sweep/images.md: they crashed or gave other tokens than their generate())"""

CACHE_ARGUMENTS = ("cache", "past_key_values")
"""the names a model's forward takes its key/value cache by: `cache` since transformers 5.24,
`past_key_values` before (5.24 still accepts it, renamed with a deprecation warning)"""

FIX = (
    "specdec supports transformers decoder-only models with an attention key/value cache "
    "(Llama, Qwen, Mistral, Gemma, Phi, GPT-2, GPT-NeoX, OPT, Falcon without ALiBi, ...); "
    "for this model use transformers' own generate()"
)


def forward_parameters(model_class: type | None) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of `model_class.forward`, or None when there is no signature to read."""
    try:
        return inspect.signature(model_class.forward).parameters  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return None


def cache_argument(model: object) -> str:
    """The keyword `model`'s forward takes its key/value cache by (`CACHE_ARGUMENTS`):
    'cache' where it names it (transformers >= 5.24), else 'past_key_values'."""
    parameters = forward_parameters(type(model))
    return "cache" if parameters is not None and "cache" in parameters else "past_key_values"


def logits_keep_argument(model: object) -> str | None:
    """The keyword `model`'s forward takes "compute logits for the last k tokens only" by:
    'logits_to_keep' (transformers >= 4.50), 'num_logits_to_keep' (4.45-4.49, still in older
    remote code), or None when it takes neither (older remote code): then every position's logits
    come back and the runner slices them. A forward taking **kwargs (or one with no readable
    signature) is assumed to know the current name."""
    parameters = forward_parameters(type(model))
    if parameters is None:
        return "logits_to_keep"
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return name
    return "logits_to_keep" if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) else None


def output_cache(output: object) -> object:
    """The key/value cache a forward returned, under either name (`CACHE_ARGUMENTS`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def tree_verification_problem(config: PretrainedConfig, model_class: type | None = None) -> str | None:
    """Why draft trees cannot be verified with a model of this config (a phrase to follow the
    model's name), or None when they can. model_class: the concrete model class when known
    (models whose forward takes no key/value cache, `CACHE_ARGUMENTS`, keep their own recurrent state)."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None) or "unknown"
    outer_type = getattr(config, "model_type", None)
    if outer_type in MODEL_TYPE_PROBLEMS:
        return f"({outer_type}) {MODEL_TYPE_PROBLEMS[outer_type]}"
    parameters = forward_parameters(model_class)  # None: no class, or no signature to read (the cache layers decide)
    if parameters is not None and not any(name in parameters for name in CACHE_ARGUMENTS):
        return (
            f"({model_type}) takes no key/value cache argument in its forward: it keeps a recurrent state of its own (RWKV, xLSTM), "
            "which a rejected draft token cannot be taken back out of, needs its images at every call (BLIP-2, InstructBLIP), "
            "or recomputes the whole sequence every step"
        )
    try:
        layers = DynamicCache(config=text).layers
    except Exception:  # a config transformers cannot lay a cache out for: the runner reports it
        layers = []
    other = sorted({type(layer).__name__ for layer in layers} - ATTENTION_CACHE_LAYERS)
    recurrent = [name for name in other if any(word in name for word in RECURRENT_LAYER_WORDS)]
    if recurrent:
        return (
            f"({model_type}) has layers with a recurrent or convolutional state ({', '.join(recurrent)}), "
            "and a rejected draft token cannot be taken back out of it"
        )
    if other:
        return (
            f"({model_type}) keeps per-layer cache state other than plain keys and values ({', '.join(other)}: e.g. a sparse-attention "
            "indexer's keys or compressed attention blocks), which specdec's slot cache cannot commit and roll back token by token yet"
        )
    # a forward taking only **kwargs may drop position ids silently (CPM-Ant, TrOCR's decoder); ALiBi models get their own reason below
    if parameters is not None and "position_ids" not in parameters and model_type not in ALIBI_MODEL_TYPES:
        return (
            f"({model_type}) takes no position ids (it positions tokens by their index in the cache or the sequence), "
            "so a draft tree's nodes would be positioned by their slot instead of their depth"
        )
    if model_type in ALIBI_MODEL_TYPES or getattr(text, "alibi", False) is True:
        return (
            f"({model_type}) adds ALiBi position biases computed from each key's index in the cache or from a 2-D padding mask, "
            "not from position ids, so a draft tree's nodes would be biased by their slot instead of their depth"
        )
    local = [kind for kind in getattr(text, "attention_layers", None) or [] if kind != "global"]
    if model_type in SLOT_WINDOW_MODEL_TYPES and local:
        return (
            f"({model_type}) limits its local attention layers to the last {getattr(text, 'window_size', '?')} slots of the cache "
            "(a fixed mask buffer indexed by slot, not by position ids), so a draft tree's nodes would see a window shifted by their slot"
        )
    types = getattr(text, "layer_types", None) or []
    unknown = sorted(set(types) - MASKED_LAYER_TYPES)
    if unknown:
        return f"({model_type}) has attention layer types {unknown} whose masks specdec does not build yet (it builds {sorted(MASKED_LAYER_TYPES)})"
    return None


def image_prompt_problem(config: PretrainedConfig, model: object | None = None) -> str | None:
    """Why prompts with images would not decode exactly with a vision-language target of this
    config (a phrase to follow the model's name), or None when they do (LLaVA-family models:
    image features scattered into image tokens that take ordinary positions and causal attention).
    model: the loaded model, when there is one (else its class is looked up from the config).

    specdec gives every token one position id (its count of committed tokens before it) and a
    causal 4-D mask. Models that position image tokens in 3-D (multimodal RoPE: a `get_rope_index`
    on the model, as Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ERNIE-4.5-VL have), let them attend
    both ways (Gemma 3, PaliGemma, Gemma 4's larger models) or read images through cross-attention (Mllama) would run with
    other positions or masks than their own, and their outputs would not be the model's.
    Text-only prompts are unaffected (their positions are 1-D in every one of these models)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if _positions_in_3d(config, model):
        return "positions image tokens in three dimensions (multimodal RoPE), which specdec's one position per token would flatten"
    if getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGE_MODEL_TYPES or getattr(text, "use_bidirectional_attention", None) in ("vision", "all", True):
        return "lets image tokens attend to each other both ways, which specdec's causal masks would not"
    if getattr(text, "cross_attention_layers", None) or getattr(config, "cross_attention_layers", None):
        return "reads images through cross-attention layers, which specdec's key/value cache does not hold"
    if getattr(config, "model_type", None) in PREFIX_IMAGE_MODEL_TYPES:
        return "puts its image embeddings before the prompt's tokens itself (no image tokens in the ids, a 2-D image mask), which specdec's positions and 4-D masks do not count"
    return None


def _positions_in_3d(config: PretrainedConfig, model: object | None) -> bool:
    """Whether the model computes multimodal RoPE positions (`get_rope_index`, on the model or
    its base model) or its config names rotary sections."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (config, text):
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(cfg, name, None)
            if isinstance(rope, dict) and ("mrope_section" in rope or "mrope_interleaved" in rope):
                return True
    if model is not None:
        return any(hasattr(m, "get_rope_index") for m in (model, getattr(model, "model", None)) if m is not None)
    try:
        from transformers import AutoModel

        base = AutoModel._model_mapping[type(config)]
    except Exception:  # remote code or a type transformers does not map: nothing to look at
        return False
    return hasattr(base, "get_rope_index")
