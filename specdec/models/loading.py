"""Loading target/draft models and tokenizers from local folders or hub ids.

Every failure a user can cause is a `SpecDecError` naming the model and the fix: a path
that is not a saved model, a folder without tokenizer files, an architecture that is not a
causal LM (BERT, T5) or whose draft trees cannot be verified (`specdec.models.support`:
recurrent state, ALiBi from the cache index), a checkpoint whose weights do not cover the model (a Llama saved
without its LM head would otherwise run with random weights), a corrupt weights file, a
loading option that needs a package that is not installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec import extras
from specdec.bundled import ASSETS, BUNDLED_LVLM, BUNDLED_PAIR, bundled_draft, bundled_lvlm_draft, bundled_lvlm_target, bundled_target  # noqa: F401 (re-exported)
from specdec.errors import SpecDecError
from specdec.models.support import FIX as UNSUPPORTED_FIX
from specdec.models.support import tree_verification_problem

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
"""accelerate's placement strategies; a device name (cuda:1) or a {module: device} dict also works"""
QUANTIZATIONS = ("4bit", "8bit")
"""bitsandbytes quantization applied while loading"""
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
"""attention kernels that take the arbitrary 4D masks tree verification needs (flash attention does not)"""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
"""any of these in a local folder means a tokenizer was saved there"""
LISTED_TENSORS = 3
"""tensor names an error message shows before '... (N in all)'"""


@dataclass(frozen=True)
class LoadOptions:
    """How one model is loaded, beyond device and dtype (`from_pretrained` keywords)."""

    device_map: str | Mapping[str, Any] | None = None
    """accelerate's placement: 'auto', 'balanced', 'balanced_low_0', 'sequential', a device
    ('cuda:1') or a {module name: device} dict; None: the whole model on `device`"""
    quantization: str | None = None
    """'4bit' or '8bit': bitsandbytes quantization while loading; None: as the checkpoint is
    (a pre-quantized checkpoint, e.g. GPTQ/AWQ/bnb, loads quantized)"""
    attn_implementation: str | None = None
    """'eager' or 'sdpa' (the kernels that take tree masks); None: transformers' default"""
    revision: str | None = None
    """a hub branch, tag or commit (hub ids only; a local folder is what it is)"""
    trust_remote_code: bool = False
    """run modelling code shipped with the checkpoint (architectures transformers does not know)"""

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise SpecDecError(f"quantization={self.quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)} (bitsandbytes) or leave it unset")
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise SpecDecError(
                f"attn_implementation={self.attn_implementation!r} is not supported: speculative decoding verifies trees with 4D attention masks, "
                f"which only {' and '.join(ATTN_IMPLEMENTATIONS)} take; use one of those"
            )
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise SpecDecError(f"revision={self.revision!r} must be a hub branch, tag or commit hash")
        if isinstance(self.device_map, str):
            if self.device_map not in DEVICE_MAPS:
                try:
                    torch.device(self.device_map)
                except RuntimeError:
                    raise SpecDecError(f"device_map={self.device_map!r} is not known; use one of {', '.join(DEVICE_MAPS)} or a device such as cuda:0") from None
        elif self.device_map is not None and not isinstance(self.device_map, Mapping):
            raise SpecDecError(f"device_map={self.device_map!r} must be a strategy name, a device or a {{module: device}} dict")


def pair_load_options(
    device_map: str | Mapping[str, Any] | None = None,
    quantization: str | None = None,
    draft_quantization: str | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    draft_revision: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[LoadOptions, LoadOptions]:
    """The target's and the draft's LoadOptions from the API's (and CLI's) loading keywords:
    device map, attention kernel and remote code for both; quantization and revision each."""
    shared: dict[str, Any] = {"device_map": device_map, "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    return LoadOptions(quantization=quantization, revision=revision, **shared), LoadOptions(quantization=draft_quantization, revision=draft_revision, **shared)


def resolve_device(device: str | None) -> torch.device:
    """'auto'/None -> CUDA when present, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise SpecDecError(f"device={device!r} is not a torch device; use 'cpu', 'cuda', 'cuda:0' or 'auto'") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecError(f"device={device!r} asked for CUDA but torch sees no GPU; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto'/None -> float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise SpecDecError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _first_line(err: BaseException) -> str:
    """An exception's message on one line (transformers' messages span many)."""
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep in name and Path(name).parent.exists() or Path(name).exists()


def _check_source(name: str, what: str, revision: str | None = None) -> str:
    """A local folder holding a saved model (config.json), or a hub id; returns what to pass to from_pretrained."""
    if not isinstance(name, str) or not name:
        raise SpecDecError(f"the {what} model name {name!r} is empty or not a string; pass a local folder or a hub id")
    expanded = os.path.expanduser(name)
    if _looks_like_path(name) and not Path(expanded).exists():
        raise SpecDecError(f"{what} model path {name!r} does not exist; pass a folder saved with save_pretrained() or a hub id")
    if not Path(expanded).exists():
        return name
    folder = Path(expanded)
    if not folder.is_dir():
        raise SpecDecError(f"{what} model path {name!r} is a file; pass the folder that holds its config.json (saved with save_pretrained())")
    if not (folder / "config.json").is_file():
        raise SpecDecError(f"{what} model folder {name!r} has no config.json, so it is not a saved model; pass a folder saved with save_pretrained() or a hub id")
    if revision is not None:
        raise SpecDecError(f"revision {revision!r} applies to hub ids, but {what} model {name!r} is a local folder; check that revision out into the folder or drop --revision")
    return expanded


def _hub_kwargs(options: LoadOptions) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
    if options.revision is not None:
        kwargs["revision"] = options.revision
    return kwargs


try:  # transformers' config checks (huggingface_hub's strict dataclasses) raise these, not ValueError
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: its configs raise ValueError
    StrictDataclassError = ValueError  # type: ignore[misc,assignment]

LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, ImportError, TypeError, StrictDataclassError)
"""what `from_pretrained` of a config, tokenizer or processor raises for a bad or missing checkpoint"""


def _load_error(what: str, name: str, part: str, err: BaseException, options: LoadOptions) -> SpecDecError:
    """A SpecDecError for a from_pretrained failure, with the likely fix."""
    text = _first_line(err)
    if isinstance(err, StrictDataclassError) and err.__cause__ is not None:
        return SpecDecError(
            f"the config.json of {what} model {name!r} fails transformers' checks ({_first_line(err.__cause__)}); "
            "fix config.json (or save the model again with save_pretrained())"
        )
    if "ignore_mismatched_sizes" in text:
        shapes = _shape_mismatches(name, options)
        detail = f": {shapes}" if shapes else " (a tensor's shape)"
        return SpecDecError(
            f"the config.json of {what} model {name!r} and its weights disagree{detail}; "
            "fix config.json's sizes (vocab_size, hidden_size, ...) or save the model again with save_pretrained()"
        )
    if "trust_remote_code" in text and not options.trust_remote_code:
        fix = "the checkpoint ships its own modelling code: pass --trust-remote-code (trust_remote_code=True) if you trust it"
    elif "safetensors" in type(err).__module__ or "deserializ" in text:
        fix = "the weights file is corrupt or truncated: download or save the model again"
    elif options.revision is not None and ("revision" in text.lower() or "not found" in text.lower()):
        fix = f"check that revision {options.revision!r} exists in the repository"
    else:
        fix = "check the name, your network or hub login for hub ids, and that the folder was saved with save_pretrained()"
    return SpecDecError(f"could not load the {part} of {what} model {name!r} ({text}); {fix}")


def load_config(name: str, what: str = "target", options: LoadOptions | None = None) -> PretrainedConfig:
    """The model's config, with clear errors (`AutoConfig.from_pretrained`)."""
    options = options or LoadOptions()
    source = _check_source(name, what, options.revision)
    try:
        return AutoConfig.from_pretrained(source, **_hub_kwargs(options))
    except LOAD_ERRORS as err:
        raise _load_error(what, name, "config", err, options) from err


def is_multimodal_source(name: str, what: str = "target", options: LoadOptions | None = None) -> bool:
    """True when the model at `name` is a vision-language (LLaVA-family) model."""
    return getattr(load_config(name, what, options), "vision_config", None) is not None


def _auto_class_names(mapping_name: str) -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, mapping_name))


def check_causal_lm(config: PretrainedConfig, name: str, what: str = "target") -> type:
    """The Auto class that loads `config` as a decoder-only LM; a SpecDecError for anything else
    (encoders such as BERT, encoder-decoders such as T5, architectures transformers does not know)."""
    model_type = getattr(config, "model_type", None) or "unknown"
    auto_map = getattr(config, "auto_map", None) or {}
    fix = "specdec needs a decoder-only causal LM (Llama, Qwen2, Mistral, GPT-2, GPT-NeoX, ...) or a LLaVA-family vision-language model"
    if getattr(config, "vision_config", None) is not None:
        if model_type not in _auto_class_names("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES") and "AutoModelForImageTextToText" not in auto_map:
            raise SpecDecError(f"{what} model {name!r} ({model_type}) is not an image-text-to-text model transformers knows; {fix}")
        check_tree_verifiable(config, name, what)
        return AutoModelForImageTextToText
    problem = text_causal_lm_problem(config)
    if problem is not None:
        raise SpecDecError(f"{what} model {name!r} {problem}; {fix}")
    check_tree_verifiable(config, name, what, _causal_lm_class(config))
    return AutoModelForCausalLM


def text_causal_lm_problem(config: PretrainedConfig) -> str | None:
    """Why a text model's `config` is not a decoder-only causal LM (a phrase to follow its name:
    an encoder-decoder, a masked-LM encoder, a type transformers has no causal LM for, unless
    remote code maps one), or None."""
    model_type = getattr(config, "model_type", None) or "unknown"
    if getattr(config, "is_encoder_decoder", False):
        return f"is an encoder-decoder model ({model_type}), not a causal LM"
    if model_type in _auto_class_names("MODEL_FOR_MASKED_LM_MAPPING_NAMES") and not getattr(config, "is_decoder", False):
        return f"is an encoder ({model_type}, a masked LM that reads both ways), not a causal LM"
    if model_type not in _auto_class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") and "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {}):
        return f"({model_type}) is not a causal LM transformers knows"
    return None


def _causal_lm_class(config: PretrainedConfig) -> type | None:
    """The class AutoModelForCausalLM builds for `config` (None for remote code or unknown types)."""
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:
        return None


def check_tree_verifiable(config: PretrainedConfig, name: str, what: str = "target", model_class: type | None = None) -> None:
    """A SpecDecError, before any weights load, for an architecture whose draft trees specdec
    cannot verify (recurrent state, ALiBi from the cache index, unbuilt mask types;
    `specdec.models.support`)."""
    problem = tree_verification_problem(config, model_class)
    if problem is not None:
        raise SpecDecError(f"{what} model {name!r} {problem}; {UNSUPPORTED_FIX}")


def _check_packages(options: LoadOptions, prequantized: bool, what: str) -> None:
    """accelerate places models (device maps, quantized models), bitsandbytes quantizes them."""
    if options.quantization:
        reason = f"{'--draft-quantization' if what == 'draft' else '--quantization'} {options.quantization}"
        needed = ["accelerate", "bitsandbytes"]
    elif options.device_map is not None:
        reason, needed = f"--device-map {options.device_map}", ["accelerate"]
    elif prequantized:
        reason, needed = f"the pre-quantized {what} checkpoint", ["accelerate"]
    else:
        return
    missing = extras.missing(*needed)
    if missing:
        raise SpecDecError(
            f"{reason} needs {' and '.join(missing)}, not installed here; install with pip install {' '.join(missing)} (or pip install 'specdec[gpu]')"
        )


def _list_tensors(names: set[str] | list[str]) -> str:
    ordered = sorted(names)
    shown = ", ".join(ordered[:LISTED_TENSORS])
    return shown + (f", ... ({len(ordered)} in all)" if len(ordered) > LISTED_TENSORS else "")


def _shape_mismatches(name: str, options: LoadOptions, shown: int = 3) -> str | None:
    """The checkpoint tensors whose shapes differ from what the config builds (`shown` of them and
    the count), read from a local folder's safetensors headers against the model built on the meta
    device; None where that cannot be read (a hub id, .bin weights)."""
    folder = Path(name).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    try:
        from safetensors import safe_open

        config = AutoConfig.from_pretrained(str(folder), **_hub_kwargs(options))
        with torch.device("meta"):
            model = check_causal_lm(config, name).from_config(config)
        expected = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
        found = []
        for file in files:
            with safe_open(str(file), framework="pt") as weights:
                for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shape = tuple(weights.get_slice(key).get_shape())
                    if key in expected and shape != expected[key]:
                        found.append(f"{key} is {list(shape)} in the weights, {list(expected[key])} from config.json")
    except Exception:  # best effort: the caller still names the problem
        return None
    if not found:
        return None
    more = f" (and {len(found) - shown} more)" if len(found) > shown else ""
    return "; ".join(found[:shown]) + more


def check_loading_info(info: Mapping[str, Any], model: PreTrainedModel, name: str, what: str = "target") -> None:
    """Refuse a checkpoint whose weights do not cover the model: missing weights would be
    random (a Llama saved without its LM head, a base model with no head at all) and
    unexpected ones mean the checkpoint is another architecture. Tied weights are not missing."""
    missing, unexpected = set(info.get("missing_keys") or ()), set(info.get("unexpected_keys") or ())
    mismatched = [str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys") or ()]
    problems = []
    if missing:
        problems.append(f"{len(missing)} weight(s) missing from the checkpoint ({_list_tensors(missing)}) would be random")
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) in the checkpoint are not in the model ({_list_tensors(unexpected)})")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) have the wrong shape ({_list_tensors(mismatched)})")
    if problems:
        raise SpecDecError(
            f"{what} model {name!r} does not match its {type(model).__name__} checkpoint: {'; '.join(problems)}; "
            "pass the folder or hub id of the complete causal LM (e.g. saved with AutoModelForCausalLM...save_pretrained(), LM head included)"
        )


def _quantization_kwargs(config: PretrainedConfig, options: LoadOptions, dtype: torch.dtype, name: str, what: str) -> dict[str, Any]:
    """quantization_config for bitsandbytes; nothing for a pre-quantized checkpoint (it loads as it is)."""
    existing = getattr(config, "quantization_config", None)
    if existing is not None and options.quantization:
        method = existing.get("quant_method") if isinstance(existing, Mapping) else getattr(existing, "quant_method", "?")
        raise SpecDecError(f"{what} model {name!r} is already quantized ({method}); drop --quantization {options.quantization}, it loads quantized as it is")
    if not options.quantization:
        return {}
    from transformers import BitsAndBytesConfig

    if options.quantization == "4bit":
        return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)}
    return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}


def load_model(
    name: str,
    what: str = "target",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    options: LoadOptions | None = None,
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` (`AutoModelForImageTextToText` for LLaVA-family
    models) with clear errors; returns the model in eval mode.

    Plain loads go to `device` in `dtype` (float32 on CPU, bfloat16 on CUDA by default).
    With a device map or quantization (requested, or a pre-quantized checkpoint) the model is
    placed while loading (a quantized model with no device map goes whole onto `device`)
    and never moved afterwards. `dtype` is then the compute dtype ('auto': the checkpoint's
    for a pre-quantized one)."""
    options = options or LoadOptions()
    config = load_config(name, what, options)
    source = _check_source(name, what, options.revision)
    auto = check_causal_lm(config, name, what)
    if options.device_map is not None and device not in (None, "auto"):
        raise SpecDecError(f"give --device {device} or --device-map {options.device_map}, not both: a device map places the model itself")
    prequantized = getattr(config, "quantization_config", None) is not None
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if isinstance(options.device_map, str) and options.device_map not in DEVICE_MAPS:
        dev = torch.device(options.device_map)
    torch_dtype = resolve_dtype(dtype, dev)
    kwargs: dict[str, Any] = {"dtype": "auto" if prequantized and dtype in (None, "auto") else torch_dtype, **_hub_kwargs(options)}
    kwargs.update(_quantization_kwargs(config, options, torch_dtype, name, what))
    if options.attn_implementation is not None:
        kwargs["attn_implementation"] = options.attn_implementation
    placed = options.device_map is not None or options.quantization is not None or prequantized
    if placed:
        _check_packages(options, prequantized, what)
        kwargs["device_map"] = dict(options.device_map) if isinstance(options.device_map, Mapping) else options.device_map or {"": str(dev)}
    try:
        model, info = auto.from_pretrained(source, output_loading_info=True, **kwargs)
    except Exception as err:  # OSError, ValueError, ImportError, safetensors' SafetensorError (an Exception), torch's RuntimeError
        if isinstance(err, SpecDecError):
            raise
        raise _load_error(what, name, "weights", err, options) from err
    check_loading_info(info, model, name, what)
    if not placed:
        model = model.to(dev)
    return model.eval()


def _check_tokenizer_files(source: str, name: str, what: str) -> None:
    folder = Path(source)
    if not folder.is_dir():
        return  # a hub id
    if any((folder / f).is_file() for f in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise SpecDecError(
        f"{what} model folder {name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); "
        "save the tokenizer there with tokenizer.save_pretrained(folder), or pass a folder or hub id that has one"
    )


def load_tokenizer(name: str, what: str = "target", options: LoadOptions | None = None) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained` with clear errors; refuses a tokenizer that holds only
    special tokens (what transformers builds for a folder that has none saved)."""
    options = options or LoadOptions()
    source = _check_source(name, what, options.revision)
    _check_tokenizer_files(source, name, what)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **_hub_kwargs(options))
    except LOAD_ERRORS as err:
        raise _load_error(what, name, "tokenizer", err, options) from err
    vocab = tokenizer.get_vocab()
    if set(vocab) <= set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()):
        raise SpecDecError(
            f"the tokenizer of {what} model {name!r} holds only its {len(vocab)} special tokens: its vocabulary files are missing; "
            "save the full tokenizer there with tokenizer.save_pretrained(folder)"
        )
    return tokenizer


def load_processor(name: str, what: str = "target", options: LoadOptions | None = None) -> Any:
    """The image+text processor of a LLaVA-family model (`AutoProcessor`)."""
    options = options or LoadOptions()
    source = _check_source(name, what, options.revision)
    try:
        return AutoProcessor.from_pretrained(source, **_hub_kwargs(options))
    except LOAD_ERRORS as err:
        raise SpecDecError(
            f"could not load the processor of {what} model {name!r}: {_first_line(err)}; a vision-language model needs its processor files"
        ) from err


def check_loaded_model(model: Any, what: str = "target") -> PreTrainedModel:
    """An already-loaded model given to the API: a transformers causal LM (or LLaVA-family
    model), put in eval mode; anything else is a SpecDecError."""
    if not isinstance(model, PreTrainedModel):
        raise SpecDecError(f"the {what} must be a folder, a hub id or a loaded transformers PreTrainedModel, got {type(model).__name__}")
    check_causal_lm(model.config, type(model).__name__, what)
    if model.get_output_embeddings() is None:
        raise SpecDecError(f"the {what} {type(model).__name__} has no LM head; pass the causal LM (e.g. AutoModelForCausalLM), not the base model")
    return model.eval()


def check_same_tokenizer(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Refuse a pair whose tokenizers map text to different ids.

    Only the vocabularies are compared: the target's EOS ids decide when a row stops, so a
    draft whose tokenizer names another EOS token (a base draft for an instruct target) is
    fine, and so are output layers of different widths (`specdec.models.vocab`). Added
    (special) tokens may differ too, with a warning: Llama 3.0 and 3.1 checkpoints name their
    reserved ids differently, and an instruct target may add chat tokens its base draft lacks.
    The draft only sees ids (one it has no row for reaches it as 0), so such a pair decodes
    exactly; the draft just guesses less well after those ids. A draft cannot make the output
    wrong; a draft whose regular tokens differ would guess nothing right, so it is refused."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab == d_vocab:
        return
    t_items, d_items = set(t_vocab.items()), set(d_vocab.items())
    # an entry only one side has is excused only when that side added it (a target's regular token
    # that the draft re-adds under another id is still a regular token moved)
    t_added, d_added = target_tok.get_added_vocab(), draft_tok.get_added_vocab()  # (built anew on every call: once each)
    regular = sorted((tok, i) for tok, i in t_items - d_items if tok not in t_added)
    regular_draft = [(tok, i) for tok, i in d_items - t_items if tok not in d_added]
    if regular or regular_draft:
        example = ", ".join(f"{tok!r} = {i}" for tok, i in (regular or sorted(regular_draft))[:3])
        raise SpecDecError(
            f"the target and draft tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens; {len(regular)} regular target tokens "
            f"missing or mapped to other ids in the draft, {len(regular_draft)} the other way, e.g. {example}); "
            "speculative decoding needs a draft that shares the target's tokenizer (added special tokens may differ)"
        )
    ids = sorted({i for _, i in t_items ^ d_items})
    shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
    logger.warning(
        "the target and draft tokenizers differ only in added tokens (%d ids: %s); decoding stays exact, "
        "the draft may guess less well after those ids", len(ids), shown,
    )


def context_length(model: PreTrainedModel) -> int | None:
    """The model's maximum number of positions, from its config (None when it sets none)."""
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def embedding_rows(model: PreTrainedModel) -> int | None:
    """Rows of the model's input embedding (the token ids it can read), or None when it has none to ask."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    rows = getattr(embeddings, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """EOS ids the way `generate()` sees them: generation_config first, then config, then tokenizer;
    ids the model could never emit (negative, or past its input embedding's rows) are dropped with a
    warning (the engine refuses them when a caller passes them itself)."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids = [value] if isinstance(value, int) else list(value)
            break
    else:
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids = [tokenizer.eos_token_id]
    rows = embedding_rows(model)
    kept = [i for i in ids if isinstance(i, int) and i >= 0 and (rows is None or i < rows)]
    if len(kept) < len(ids):
        logger.warning("EOS ids %s from the model's configs are outside its token ids and are ignored", [i for i in ids if i not in kept])
    return kept
