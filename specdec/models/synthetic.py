"""Synthetic target/draft pairs of real shapes, for timing and what-if studies (`specdec synth-pair`).

No model can be downloaded here, and the bundled pair is 28M parameters; real users run
1B-70B targets. A synthetic pair has a real architecture and size and a draft whose greedy
agreement with the target is chosen, so speedups can be measured at that scale and at any
agreement. Its text means nothing: it is for timing and what-if studies only.

Construction (docs/synthetic-pairs.md has the reasons):

- **target**: the shape's architecture and size with random Gaussian weights (std
  `initializer_range`; norms 1, biases 0). In every layer but the first the output
  projections (attention `o_proj` and MLP `down_proj`, or the architecture's equivalents,
  `OUTPUT_PROJECTIONS`) are zero, so those layers add exactly 0 to the residual stream: the
  target pays for a full forward but computes its first layer's function. Its head is
  multiplied by `head_scale` so that its distributions are peaked like a trained model's.
- **draft**: the target's first `draft_layers` layers (layer 0 computes, the others are the
  target's zeroed layers and only add cost), the same embeddings and final norm, and the
  target's head mixed with Gaussian noise: head_scale * (W + σ E) / sqrt(1 + σ²), with E
  drawn like W. The division keeps the draft's logits at the target's scale. σ is calibrated
  so that the draft's argmax equals the target's on the requested share of decode positions.
- **greedy agreement**: the share of decode positions where argmax(draft logits) =
  argmax(target logits). Decode positions are those of the target's own greedy
  continuation of random-token prompts (each position predicts the next token), the
  contexts a greedy speculative decoder verifies.
- **cheap calibration**: the target computes its first layer's function, so its final
  hidden states are those of a one-layer model (the *reference*: the target's embeddings,
  layer 0 and final norm). Both heads are applied to the reference's hidden states; no
  forward of the full target is needed, which is what makes an 8B shape calibratable on a
  CPU. σ is fitted on one set of positions and the achieved agreement is measured on
  another (held out). Pairs up to `FULL_CHECK_MAX_PARAMS` are also checked end to end: the
  saved target and draft are loaded and run on the held-out contexts, and the target must
  reproduce the reference's logits.

Weights are generated tensor by tensor from seeds derived from (seed, tensor name, block), so
the target and draft share their common tensors without either being kept in memory, and a
model is written shard by shard in `save_pretrained`'s format (safetensors shards + index,
config.json, generation_config.json, tokenizer), never whole. The peak of memory is the
float32 reference during calibration (8.8 GiB measured for llama-3-8b, docs/synthetic-pairs.md).

Every saved pair also gets a word-level tokenizer whose tokens are "t1" ... "t{V-1}" (id 0
is "<unk>"), so `len(tokenizer)` equals the vocabulary and any token id round-trips through
text ("t17 t4021"), and `prompts.jsonl`, random-token prompts in that spelling. The pair has
no EOS token: every row runs to its token budget.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from specdec.errors import SpecDecError
from specdec.models.loading import ASSETS, DTYPES, resolve_device, text_causal_lm_problem

SHAPES_DIR = ASSETS / "shapes"
"""the named shapes: one JSON file per name, {"source", "notes", "config": <the model's config.json>}"""

FORMAT_VERSION = 1
"""bumped when the construction changes, so cached pairs of an older construction are rebuilt"""

OUTPUT_PROJECTIONS = frozenset({"o_proj", "down_proj", "dense", "dense_4h_to_h", "c_proj", "out_proj", "fc2", "fc_out", "wo", "w2"})
"""module names of the projections that write a layer's attention or MLP output into the
residual stream (Llama/Qwen/Mistral: o_proj, down_proj; GPT-NeoX: dense, dense_4h_to_h;
GPT-2: c_proj; OPT/GPT-J: out_proj, fc2, fc_out)"""

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
"""the first numeric component of a parameter name is its layer: model.layers.3.mlp.down_proj.weight -> 3"""

AUTO_TOP1 = 0.75
"""head_scale "auto": the scale at which the target's mean top-1 probability (temperature 1)
over the calibration positions is this; a chosen figure for "peaked like a trained model"
(override it with an explicit head_scale)"""

CHUNK_VALUES = 1 << 24
"""values per generated block (64 MiB in float32); blocks are seeded one by one"""

SHARD_BYTES = 1 << 30
"""largest safetensors shard written (1 GiB; a bigger single tensor gets a shard of its own)"""

FULL_CHECK_MAX_PARAMS = 300_000_000
"""targets up to this many parameters are also checked end to end (full target and draft forwards)"""

PROMPT_SET_SIZE = 64
"""random-token prompts written to prompts.jsonl"""

UNK_TOKEN = "<unk>"
"""id 0 of the word-level tokenizer; ids 1..V-1 are spelled t1..t{V-1}"""

PAIR_FILE = "synth_pair.json"
CALIBRATION_FILE = "calibration.safetensors"
PROMPTS_FILE = "prompts.jsonl"

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


@dataclass(frozen=True)
class Calibration:
    """The decode contexts on which the head scale and σ are fitted and the agreement measured."""

    sequences: int = 64
    """random-token prompts per set (one set fits σ and the head scale, one is held out)"""
    new_tokens: int = 64
    """greedy tokens generated after each prompt: its decode positions"""


CALIBRATION = Calibration()


# ----- shapes ---------------------------------------------------------------------------


@dataclass
class Shape:
    """A model shape: a real model's config.json (random weights are drawn for it)."""

    name: str
    """the named shape, or the config.json path it was read from"""
    config: dict[str, Any]
    """config.json fields"""
    source: str | None = None
    """the model whose shape this is (hub id), when known"""
    notes: str = ""
    flag: str = "--shape"
    """the option that gave the shape, named in errors"""


def shape_names() -> list[str]:
    """The named shapes (files in specdec/assets/shapes)."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_shape(shape: str, flag: str = "--shape") -> Shape:
    """A named shape, or any config.json file (a folder holding one works too). flag: the
    option that gave it, named in errors."""
    if not shape.strip():
        raise SpecDecError(f"{flag} is empty; give a named shape ({', '.join(shape_names())}) or a config.json path")
    named = SHAPES_DIR / f"{shape}.json"
    if named.is_file():
        data = json.loads(named.read_text(encoding="utf-8"))
        return Shape(name=shape, config=dict(data["config"]), source=data.get("source"), notes=data.get("notes", ""), flag=flag)
    path = Path(shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SpecDecError(f"{flag} {shape!r} is neither a named shape ({', '.join(shape_names())}) nor a config.json file; pick a name or give a config.json path")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SpecDecError(f"{flag} {shape!r}: could not read it as JSON ({err}); give a model's config.json") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise SpecDecError(f"{flag} {shape!r} has no 'model_type'; give a Hugging Face config.json (e.g. a model folder's config.json)")
    return Shape(name=str(path), config=config, source=config.get("_name_or_path") or None, flag=flag)


# ----- what defines a pair -------------------------------------------------------------


@dataclass
class TargetSpec:
    """What defines a synthetic target (and so the cache key of its folder)."""

    shape: str
    """a named shape (`shape_names()`) or a config.json path"""
    dtype: str = "bfloat16"
    """saved dtype: float32, float16 or bfloat16 (the released checkpoints' dtype)"""
    seed: int = 0
    """seeds every weight, the prompts and the calibration contexts"""
    head_scale: float | None = None
    """factor on the target's head; None: "auto" (the scale where the mean top-1 probability is AUTO_TOP1)"""
    prompt_tokens: int = 64
    """length of the random-token prompts (calibration and prompts.jsonl)"""

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise SpecDecError(f"--dtype {self.dtype!r} is not supported; use one of {', '.join(sorted(DTYPES))}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise SpecDecError(f"--seed {self.seed!r} must be a non-negative integer")
        if self.head_scale is not None and not (isinstance(self.head_scale, int | float) and math.isfinite(self.head_scale) and self.head_scale > 0):
            raise SpecDecError(f"--head-scale {self.head_scale!r} must be a positive number or 'auto'")
        if not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 1:
            raise SpecDecError(f"--prompt-tokens {self.prompt_tokens!r} must be a positive integer")


@dataclass
class DraftSpec:
    """What defines a synthetic draft of a given target."""

    agreement: float
    """requested greedy agreement with the target, in (0, 1]"""
    draft_layers: int = 1
    """layers of the draft (the target's first ones); its cost grows with them, its function does not"""

    def validate(self, target_layers: int | None = None) -> None:
        if not (isinstance(self.agreement, int | float) and 0 < self.agreement <= 1):
            raise SpecDecError(f"--agreement {self.agreement!r} must be in (0, 1]: the share of positions where the draft's argmax equals the target's, e.g. 0.8")
        if not isinstance(self.draft_layers, int) or self.draft_layers < 1:
            raise SpecDecError(f"--draft-layers {self.draft_layers!r} must be a positive integer (1: the target's first layer only)")
        if target_layers is not None and self.draft_layers >= target_layers:
            raise SpecDecError(f"--draft-layers {self.draft_layers} must be below the target's {target_layers} layers; a draft as deep as the target saves nothing")


def parse_head_scale(text: str) -> float | None:
    """'auto' -> None; a positive number -> itself."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise SpecDecError(f"--head-scale {text!r} must be 'auto' or a positive number, e.g. 20") from None
    if not (math.isfinite(value) and value > 0):
        raise SpecDecError(f"--head-scale {text!r} must be 'auto' or a positive number, e.g. 20")
    return value


# ----- records (synth_pair.json) -------------------------------------------------------


@dataclass
class TargetInfo:
    """The built target, as recorded in synth_pair.json."""

    shape: str
    source: str | None
    model_type: str
    dims: dict[str, Any]
    """hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings"""
    dtype: str
    seed: int
    head_scale: float
    head_scale_auto: bool
    target_top1: float
    """mean top-1 probability of the target (temperature 1) over the held-out decode positions"""
    params: int
    prompt_tokens: int
    calibration: dict[str, int]
    """sequences and new tokens per set, fit and check positions"""
    notes: list[str]
    """what differs from the shape's config (sliding window dropped, embeddings untied, no EOS, ...)"""
    format: int = FORMAT_VERSION


@dataclass
class DraftInfo:
    """One built draft, as recorded in synth_pair.json."""

    folder: str
    """the draft's folder, relative to the pair's root"""
    agreement_requested: float
    agreement_achieved: float
    """greedy agreement on the held-out decode positions, with the saved weights"""
    agreement_fit: float
    """greedy agreement on the positions σ was fitted on"""
    noise_std: float
    """σ: the noise's std relative to the head's init std (before the head scale)"""
    draft_layers: int
    params: int
    draft_top1: float
    """mean top-1 probability of the draft (temperature 1) over the held-out positions"""
    measured_with: str
    """'full models' (saved target and draft run end to end) or 'first layer + heads' (the cheap method)"""
    check_positions: int


@dataclass
class PairRecord:
    """synth_pair.json: the target and every draft built beside it."""

    target: TargetInfo
    drafts: dict[str, DraftInfo] = field(default_factory=dict)
    purpose: str = "timing and what-if studies only: random weights, the text is meaningless"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairRecord:
        return cls(
            target=TargetInfo(**data["target"]),
            drafts={k: DraftInfo(**v) for k, v in data.get("drafts", {}).items()},
            purpose=data.get("purpose", cls.purpose),
        )

    def save(self, root: Path) -> Path:
        path = root / PAIR_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path


def read_record(root: Path) -> PairRecord | None:
    """The pair folder's record, or None when its target is not (completely) built or is of an older construction."""
    path = root / PAIR_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = PairRecord.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return record if record.target.format == FORMAT_VERSION else None


# ----- configs ---------------------------------------------------------------------------


def target_config(shape: Shape, dtype: str) -> tuple[PretrainedConfig, list[str]]:
    """The synthetic target's config and what it changes from the shape's config.json."""
    fields = {k: v for k, v in shape.config.items() if k not in ("torch_dtype", "dtype", "_name_or_path", "transformers_version", "quantization_config")}
    notes: list[str] = []
    if fields.get("tie_word_embeddings", True):
        notes.append("embeddings untied (the head gets the scale and the draft's noise; the embeddings keep neither); cost per forward is unchanged")
    fields["tie_word_embeddings"] = False
    if fields.get("sliding_window") is not None and (fields.get("use_sliding_window", True) or fields.get("model_type") == "mistral"):
        notes.append(f"sliding window {fields['sliding_window']} dropped (static shapes and CUDA graphs do not support sliding-window models yet)")
    if "sliding_window" in fields:
        fields["sliding_window"] = None
    if "use_sliding_window" in fields:
        fields["use_sliding_window"] = False
    types = fields.get("layer_types")
    if isinstance(types, list) and any("sliding" in str(t) for t in types):
        notes.append("sliding-attention layers made full-attention layers")
        fields["layer_types"] = ["full_attention" for _ in types]
    notes.append("no EOS token: every row runs to its token budget")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields[key] = None
    model_type = fields.pop("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise SpecDecError(
            f"{shape.flag} {shape.name!r}: model_type {model_type!r} is not one transformers knows; "
            "give a decoder-only config (llama, qwen2, mistral, gpt2, gpt_neox, ...)"
        )
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (StrictDataclassError, ValueError, TypeError, KeyError, ArithmeticError) as err:
        # transformers validates configs with huggingface_hub's strict dataclasses; their message
        # wraps the validator's own (err.__cause__), which is the reason to show
        reason = " ".join(str(err.__cause__ or err).split()).rstrip(". ") or type(err).__name__
        raise SpecDecError(f"{shape.flag} {shape.name!r} is not a valid {model_type} config: {reason}; fix the file") from None
    check_causal(config, shape)
    config.dtype = DTYPES[dtype]
    return config, notes


def check_causal(config: PretrainedConfig, shape: Shape) -> None:
    """A SpecDecError, before anything is built, for a config that is not a decoder-only causal LM
    (`specdec.models.loading.text_causal_lm_problem`; a vision-language config is refused too:
    synth-pair builds text models)."""
    model_type = config.model_type
    fix = "synth-pair needs a decoder-only causal LM config (Llama, Qwen2, Mistral, GPT-2, GPT-NeoX, ...)"
    what = f"{shape.flag} {shape.name!r}"
    if getattr(config, "vision_config", None) is not None:
        raise SpecDecError(f"{what} is a vision-language model ({model_type}), not a text-only causal LM; {fix} (e.g. its text_config)")
    problem = text_causal_lm_problem(config)
    if problem is not None:
        raise SpecDecError(f"{what} {problem}; {fix}")


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of `config` with `layers` decoder layers (per-layer lists cut to match)."""
    out = copy.deepcopy(config)
    if isinstance(getattr(out, "layer_types", None), list):
        out.layer_types = out.layer_types[:layers]
    out.num_hidden_layers = layers
    return out


def num_layers(config: PretrainedConfig) -> int:
    value = getattr(config, "num_hidden_layers", None)
    if not isinstance(value, int) or value < 1:
        raise SpecDecError(f"config of type {config.model_type!r} has no num_hidden_layers; synth-pair needs a decoder-only model with layers")
    return value


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model on the meta device: names and shapes of every tensor, no memory."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    except (ValueError, TypeError, KeyError) as err:
        raise SpecDecError(f"model type {config.model_type!r} is not a causal LM transformers can build ({err}); use a decoder-only config") from None


# ----- weights ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """How one named tensor of a synthetic model is filled."""

    name: str
    shape: tuple[int, ...]
    kind: str
    """'normal' (Gaussian, std), 'zero' (biases; output projections of layers >= 1), 'one' (norm weights), 'head'"""
    std: float = 0.0


def _layer_of(name: str) -> int | None:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def _module_of(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def plan_tensors(model: PreTrainedModel) -> tuple[list[TensorPlan], str]:
    """Every state-dict tensor of `model` (on meta) with its fill, and the head's name.

    Raises when a layer >= 1 has no recognisable attention and MLP output projections
    (the construction would not reduce it to the identity).
    """
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise SpecDecError(f"model type {model.config.model_type!r} has no output head; synth-pair needs a causal LM")
    std = float(getattr(model.config, "initializer_range", 0.02) or 0.02)
    parameters = dict(model.named_parameters())
    head_name = next((n for n, p in parameters.items() if p is head.weight), "")
    zeroed: dict[int, list[str]] = {}
    plans: list[TensorPlan] = []
    for name, tensor in model.state_dict().items():
        if name not in parameters:
            raise SpecDecError(f"model type {model.config.model_type!r}: {name} is a saved buffer, not a parameter; synth-pair cannot fill it")
        shape = tuple(tensor.shape)
        layer = _layer_of(name)
        if name == head_name:
            kind = "head"
        elif layer is not None and layer >= 1 and _module_of(name) in OUTPUT_PROJECTIONS:
            kind = "zero"
            zeroed.setdefault(layer, []).append(name)
        elif name.endswith("bias"):
            kind = "zero"
        elif len(shape) <= 1:
            kind = "one"
        else:
            kind = "normal"
        plans.append(TensorPlan(name=name, shape=shape, kind=kind, std=std))
    if not head_name:
        raise SpecDecError(f"model type {model.config.model_type!r}: its head shares its weight with another tensor; synth-pair needs an untied head")
    for layer in range(1, num_layers(model.config)):
        projections = {n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n for n in zeroed.get(layer, [])}
        if len(projections) < 2:
            raise SpecDecError(
                f"model type {model.config.model_type!r}: layer {layer} has no recognisable attention and MLP output projections "
                f"(found {sorted(projections) or 'none'}; synth-pair knows {', '.join(sorted(OUTPUT_PROJECTIONS))}); "
                "use a Llama, Qwen2, Mistral, GPT-NeoX or GPT-2 style config"
            )
    return plans, head_name


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"specdec-synth:{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def gaussian_rows(seed: int, name: str, shape: tuple[int, ...], std: float, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the Gaussian tensor `name` (first dimension = rows), float32.

    The tensor is drawn in blocks of whole rows, each block from its own seed, so any row
    range is reproducible without drawing the rest: gaussian_rows(..., 0, n)[a:b] equals
    gaussian_rows(..., a, b). Returns [stop - start, prod(shape[1:])].
    """
    row_len = math.prod(shape[1:]) if len(shape) > 1 else 1
    per_block = max(1, CHUNK_VALUES // row_len)
    out = torch.empty(stop - start, row_len, dtype=torch.float32)  # [rows, row_len]
    for block in range(start // per_block, (stop - 1) // per_block + 1):
        b0, b1 = block * per_block, min((block + 1) * per_block, shape[0])
        generator = torch.Generator().manual_seed(_block_seed(seed, name, block))
        values = torch.randn(b1 - b0, row_len, generator=generator, dtype=torch.float32)  # [block rows, row_len]
        lo, hi = max(b0, start), min(b1, stop)
        out[lo - start : hi - start] = values[lo - b0 : hi - b0]
    return out.mul_(std)


def head_rows(seed: int, plan: TensorPlan, scale: float, noise_std: float, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a head: scale * (W + σ E) / sqrt(1 + σ²), float32 [rows, hidden]."""
    rows = gaussian_rows(seed, plan.name, plan.shape, plan.std, start, stop)
    if noise_std > 0:
        rows.add_(gaussian_rows(seed, plan.name + "#noise", plan.shape, plan.std, start, stop), alpha=noise_std)
        rows.div_(math.sqrt(1.0 + noise_std**2))
    return rows.mul_(scale)


def _block_rows(plan: TensorPlan) -> int:
    row_len = math.prod(plan.shape[1:]) if len(plan.shape) > 1 else 1
    return max(1, CHUNK_VALUES // row_len)


def make_tensor(seed: int, plan: TensorPlan, dtype: torch.dtype, head_scale: float = 1.0, noise_std: float = 0.0) -> torch.Tensor:
    """The full tensor of `plan` in `dtype`, filled block by block (never a float32 copy of the whole)."""
    if plan.kind == "zero":
        return torch.zeros(plan.shape, dtype=dtype)
    if plan.kind == "one":
        return torch.ones(plan.shape, dtype=dtype)
    out = torch.empty(plan.shape, dtype=dtype)
    flat = out.view(plan.shape[0], -1) if len(plan.shape) > 1 else out.view(-1, 1)
    step = _block_rows(plan)
    for start in range(0, plan.shape[0], step):
        stop = min(start + step, plan.shape[0])
        if plan.kind == "head":
            flat[start:stop] = head_rows(seed, plan, head_scale, noise_std, start, stop).to(dtype)
        else:
            flat[start:stop] = gaussian_rows(seed, plan.name, plan.shape, plan.std, start, stop).to(dtype)
    return out


def write_model(
    folder: Path, config: PretrainedConfig, tensors: Iterator[tuple[str, torch.Tensor]], tokenizer_vocab: int, shard_bytes: int = SHARD_BYTES
) -> int:
    """Write a model folder as `save_pretrained` does (config.json, generation_config.json,
    model.safetensors or model-0000i-of-0000n.safetensors + model.safetensors.index.json) and
    the word-level tokenizer, one shard at a time; returns the number of parameters."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    save_tokenizer(folder, tokenizer_vocab, getattr(config, "max_position_embeddings", None))
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = params = 0
    tmp_names: list[Path] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        path = folder / f"shard-{len(shards):05d}.tmp"
        save_file(pending, str(path), metadata={"format": "pt"})
        tmp_names.append(path)
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > shard_bytes:
            flush()
        pending[name] = tensor.contiguous()
        pending_bytes += size
        total_bytes += size
        params += tensor.numel()
    flush()
    if len(shards) == 1:
        tmp_names[0].replace(folder / "model.safetensors")
        return params
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(zip(tmp_names, shards, strict=True)):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path.replace(folder / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return params


def save_tokenizer(folder: Path, vocab_size: int, max_length: int | None) -> None:
    """The word-level tokenizer: id 0 is UNK_TOKEN, id i > 0 is "t{i}"; whitespace-separated."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {UNK_TOKEN: 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK_TOKEN, clean_up_tokenization_spaces=False, model_max_length=max_length or 1_000_000
    )
    tokenizer.save_pretrained(folder)


def ids_to_text(ids: list[int]) -> str:
    """Token ids in the word-level tokenizer's spelling: [17, 4021] -> "t17 t4021"."""
    return " ".join(f"t{i}" if i > 0 else UNK_TOKEN for i in ids)


def random_prompts(vocab_size: int, count: int, length: int, seed: int, salt: str) -> torch.Tensor:
    """[count, length] token ids drawn uniformly from 1..V-1 (0 is the tokenizer's UNK)."""
    generator = torch.Generator().manual_seed(_block_seed(seed, f"prompts:{salt}", 0))
    return torch.randint(1, vocab_size, (count, length), generator=generator)


# ----- the reference (first-layer) model and calibration ------------------------------


def build_reference(config: PretrainedConfig, seed: int, device: torch.device) -> tuple[PreTrainedModel, TensorPlan]:
    """The one-layer model the target and draft both compute (embeddings, layer 0, final norm),
    float32, with the unscaled head W; weights rounded through the saved dtype first."""
    saved_dtype = config.dtype
    one = with_layers(config, 1)
    plans, head_name = plan_tensors(meta_model(one))
    one.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(one, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    head_plan = next(p for p in plans if p.name == head_name)
    with torch.no_grad():
        for plan in plans:
            params[plan.name].copy_(make_tensor(seed, plan, saved_dtype))  # rounded through the saved dtype
    return model.to(device), head_plan


@dataclass
class Contexts:
    """Decode contexts of one calibration set."""

    ids: torch.Tensor
    """[sequences, prompt + new] the random prompts and their greedy continuations"""
    hidden: torch.Tensor
    """[sequences * new, hidden] final hidden states at the decode positions, float32"""
    prompt_tokens: int


def decode_contexts(reference: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> Contexts:
    """Greedy continuations of `prompts` [S, P] by the reference (= the target's function) and the
    final hidden states at their decode positions (P-1 .. P+N-2: each predicts the next token)."""
    device = next(reference.parameters()).device
    prompts = prompts.to(device)
    p = prompts.shape[1]
    with torch.inference_mode():
        seqs = reference.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )  # [S, P + N]
        hidden = reference.base_model(input_ids=seqs, attention_mask=torch.ones_like(seqs)).last_hidden_state[:, p - 1 : -1].float()  # [S, N, H]
        logits = reference(input_ids=seqs[:1], attention_mask=torch.ones_like(seqs[:1])).logits[0, p - 1 : -1].float()  # [N, V]
        recomputed = reference.get_output_embeddings()(hidden[0]).float()  # [N, V]
    if not torch.allclose(logits, recomputed, atol=1e-3, rtol=1e-3):
        raise SpecDecError(
            f"model type {reference.config.model_type!r} transforms its logits after the head (e.g. soft-capping); synth-pair needs logits = head(final hidden state)"
        )
    return Contexts(ids=seqs.cpu(), hidden=hidden.reshape(-1, hidden.shape[-1]).contiguous(), prompt_tokens=p)


Rows = Callable[[int, int], torch.Tensor]
"""rows(start, stop) -> [stop - start, hidden]: a block of a head's rows, float32"""


def _blocks(vocab: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, vocab, step):
        yield start, min(start + step, vocab)


def head_argmax(hidden: torch.Tensor, rows: Rows, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax over the vocabulary of hidden @ head^T and its softmax probability (temperature 1),
    with a running max and log-sum-exp over blocks of head rows (never [N, V]).

    hidden [N, H] -> (argmax [N], top-1 probability [N])."""
    n = hidden.shape[0]
    best = torch.full((n,), -math.inf, device=hidden.device)
    arg = torch.zeros(n, dtype=torch.long, device=hidden.device)
    lse = torch.full((n,), -math.inf, device=hidden.device)
    for start, stop in _blocks(vocab, step):
        logits = hidden @ rows(start, stop).to(hidden.device).T  # [N, block]
        value, index = logits.max(dim=-1)
        better = value > best
        best = torch.where(better, value, best)
        arg = torch.where(better, index + start, arg)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    return arg.cpu(), torch.exp(best - lse).cpu()


def critical_noise(hidden: torch.Tensor, target_arg: torch.Tensor, clean: Rows, noise: Rows, vocab: int, step: int) -> torch.Tensor:
    """Per position, the noise level σ* above which the draft's argmax leaves the target's token.

    The draft's logits are proportional to a + σ b, with a = hidden @ W^T (the clean head) and
    b = hidden @ E^T (the noise). Token v overtakes the target's token t when
    σ (b_v - b_t) > a_t - a_v, so the draft agrees exactly for σ < σ* = min over v with
    b_v > b_t of (a_t - a_v) / (b_v - b_t) (inf when no such v; 0 when some v already leads
    at σ = 0, a rounding near-tie). The agreement at σ is then the share of positions with
    σ* > σ. Two passes over blocks of head rows, never [N, V].

    hidden [N, H], target_arg [N] -> σ* [N]."""
    device = hidden.device
    target = target_arg.to(device)
    a_t = torch.zeros(hidden.shape[0], device=device)  # [N] the target token's clean logit
    b_t = torch.zeros(hidden.shape[0], device=device)  # [N] its noise logit
    for start, stop in _blocks(vocab, step):
        inside = ((target >= start) & (target < stop)).nonzero().squeeze(-1)  # positions whose token is in this block
        if inside.numel():
            local = target[inside] - start
            a_t[inside] = (hidden[inside] * clean(start, stop).to(device)[local]).sum(-1)
            b_t[inside] = (hidden[inside] * noise(start, stop).to(device)[local]).sum(-1)
    sigma = torch.full((hidden.shape[0],), math.inf, device=device)
    for start, stop in _blocks(vocab, step):
        gap = a_t[:, None] - hidden @ clean(start, stop).to(device).T  # [N, block] a_t - a_v
        slope = hidden @ noise(start, stop).to(device).T - b_t[:, None]  # [N, block] b_v - b_t
        crossing = torch.where(slope > 0, gap / slope.clamp_min(1e-30), torch.full_like(gap, math.inf))
        crossing = torch.where(gap < 0, torch.zeros_like(gap), crossing)
        own = torch.arange(start, stop, device=device)[None, :] == target[:, None]  # [N, block] the target token itself
        crossing = crossing.masked_fill(own, math.inf)
        sigma = torch.minimum(sigma, crossing.min(dim=-1).values.clamp_min(0.0))
    return sigma.cpu()


def noise_for_agreement(critical: torch.Tensor, agreement: float) -> tuple[float, float]:
    """σ whose agreement (share of positions with σ* > σ) is closest to `agreement`, and that share.

    Worked example: σ* = [0.1, 0.2, 0.4, inf], agreement 0.5 -> σ between 0.2 and 0.4
    (geometric mean 0.283): positions 3 and 4 keep agreeing, 2 of 4."""
    values = torch.sort(critical.double()).values  # ascending
    n = values.numel()
    if agreement >= 1.0:
        return 0.0, float((values > 0).double().mean())
    k = min(n, max(0, round((1.0 - agreement) * n)))  # positions to lose
    lower = float(values[k - 1]) if k > 0 else 0.0
    upper = float(values[k]) if k < n else math.inf
    if math.isinf(lower):
        raise SpecDecError(f"--agreement {agreement} is below what noise can reach on this shape ({float((values == math.inf).double().mean()):.3f}); ask for a higher agreement")
    if math.isinf(upper):
        sigma = max(2.0 * lower, 1.0)
    elif lower > 0:
        sigma = math.sqrt(lower * upper)
    else:
        sigma = upper / 2
    return sigma, float((values > sigma).double().mean())


def fit_head_scale(a0: torch.Tensor, top1: float = AUTO_TOP1, iterations: int = 50) -> float:
    """The factor S on the head at which the mean top-1 probability of softmax(S * a0) is `top1`
    (bisection in log space: the top-1 probability grows with S). a0 [N, V] = hidden @ W^T."""

    def mean_top1(scale: float) -> float:
        return float(torch.softmax(scale * a0, dim=-1).max(dim=-1).values.mean())

    lo, hi = -3.0, 6.0  # log10 of S
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if mean_top1(10**mid) < top1:
            lo = mid
        else:
            hi = mid
    return float(10 ** ((lo + hi) / 2))


HEAD_SCALE_POSITIONS = 512
"""positions whose full logits [N, V] are kept to fit the auto head scale"""


# ----- building --------------------------------------------------------------------------


def _dims(config: PretrainedConfig) -> dict[str, Any]:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings")
    return {k: getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)}


def _check_positions(config: PretrainedConfig, prompt_tokens: int, calibration: Calibration) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    need = prompt_tokens + calibration.new_tokens
    if isinstance(limit, int) and need > limit:
        raise SpecDecError(f"--prompt-tokens {prompt_tokens} + {calibration.new_tokens} calibration tokens exceed the shape's {limit} positions; lower --prompt-tokens")


def _vocab(config: PretrainedConfig) -> int:
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise SpecDecError(f"config of type {config.model_type!r} has no vocab_size; synth-pair needs a text model")
    return vocab


def _heads(seed: int, plan: TensorPlan, scale: float, dtype: torch.dtype) -> tuple[Rows, Rows, Rows]:
    """Row producers of the target's head as saved (rounded through `dtype`), of the clean head W and of the noise E."""

    def target(a: int, b: int) -> torch.Tensor:
        return head_rows(seed, plan, scale, 0.0, a, b).to(dtype).float()

    def clean(a: int, b: int) -> torch.Tensor:
        return gaussian_rows(seed, plan.name, plan.shape, plan.std, a, b)

    def noise(a: int, b: int) -> torch.Tensor:
        return gaussian_rows(seed, plan.name + "#noise", plan.shape, plan.std, a, b)

    return target, clean, noise


# ----- memory ----------------------------------------------------------------------------


def available_memory() -> int | None:
    """Bytes of RAM this process can still allocate without swapping (Linux MemAvailable, else
    free physical pages); None where the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def available_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device (None for other devices)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


@dataclass(frozen=True)
class MemoryEstimate:
    """What building a pair (target + one draft) allocates at its peak, from the code's own
    allocations (`estimate_memory`); the weights themselves are streamed to disk and never held whole."""

    target_params: int
    draft_params: int
    host_bytes: int
    """peak of CPU memory"""
    host_phase: str
    """the step at that peak"""
    device_bytes: int
    """peak on the calibration device when it is not the CPU (0 on the CPU: counted in host_bytes)"""
    device_phase: str


def estimate_memory(
    config: PretrainedConfig, plans: list[TensorPlan], dtype: torch.dtype, prompt_tokens: int, calibration: Calibration,
    draft_layers: int = 1, device: torch.device | None = None,
) -> MemoryEstimate:
    """Peak memory of build_target + build_draft, step by step as they allocate (a lower bound:
    Python, torch and allocator overheads come on top):

    - reference: the float32 one-layer model (embeddings, layer 0, norm, head) + one saved-dtype tensor being filled;
    - calibration: the reference + the activations of its forward over every calibration context
      (2 x sequences contexts of prompt + new tokens: 3 MLP-wide and 4 hidden-wide float32 values per
      token, the attention scores) + the kept hidden states;
    - writing: a pending shard (up to SHARD_BYTES, or the largest tensor; at most the whole target) + the next
      tensor + a generated block;
    - draft calibration: the fit hidden states and a few [positions, head block] float32 matrices;
    - full check (targets up to FULL_CHECK_MAX_PARAMS): the target and draft loaded whole in float32.
    """
    device = device or torch.device("cpu")
    on_host = device.type != "cuda"
    numel = {p.name: math.prod(p.shape) for p in plans}

    def first(n_layers: int) -> list[int]:  # the tensors of a model of the first n_layers layers
        return [n for name, n in numel.items() if (index := _layer_of(name)) is None or index < n_layers]

    target = sum(numel.values())
    reference = sum(first(1))
    draft = sum(first(draft_layers))
    largest = max(numel.values(), default=0)
    largest_reference = max(first(1), default=0)
    size = dtype.itemsize
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    mlp = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    length = prompt_tokens + calibration.new_tokens
    tokens = 2 * calibration.sequences * length
    positions = calibration.sequences * calibration.new_tokens  # per set (fit, check)
    block = min(vocab, max(1, CHUNK_VALUES // max(hidden, 1)))  # head rows per block
    generated = 2 * CHUNK_VALUES * 4  # a float32 block being drawn + its rows

    kept = 4 * 2 * positions * hidden  # fit + check hidden states, float32
    steps: dict[str, tuple[bool, int]] = {  # step -> (on the host, bytes)
        "building the float32 first-layer reference": (True, 4 * reference + largest_reference * size + generated),
        "calibrating with the float32 first-layer reference": (
            on_host, 4 * reference + 4 * tokens * (3 * mlp + 4 * hidden) + 4 * tokens * heads * length + kept,
        ),
        "fitting the head scale": (on_host, kept + 4 * HEAD_SCALE_POSITIONS * vocab + 3 * 4 * positions * block),
        "writing the weights": (True, kept + min(max(SHARD_BYTES, largest * size), target * size) + largest * size + generated),
        "calibrating the draft": (on_host, 4 * positions * hidden + 6 * 4 * positions * block + 2 * 4 * block * hidden),
    }
    if target <= FULL_CHECK_MAX_PARAMS:
        rows = 4
        steps["checking the pair end to end"] = (on_host, 4 * (target + draft) + 3 * 4 * rows * length * vocab + 4 * rows * length * (3 * mlp + 4 * hidden))
    host = max(((b, s) for s, (h, b) in steps.items() if h), default=(0, ""))
    dev = max(((b, s) for s, (h, b) in steps.items() if not h), default=(0, ""))
    return MemoryEstimate(target_params=target, draft_params=draft, host_bytes=host[0], host_phase=host[1], device_bytes=dev[0], device_phase=dev[1])


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def check_memory(shape: Shape, estimate: MemoryEstimate, device: torch.device) -> None:
    """A SpecDecError, before anything is built, when the pair clearly cannot be built here: the
    estimated peak exceeds the memory available now (RAM; free GPU memory for calibration on CUDA).
    Skipped where the system does not say what is available."""
    sizes = f"a {estimate.target_params / 1e9:,.2f}B-parameter target and {estimate.draft_params / 1e9:,.2f}B-parameter draft"
    fix = "use a smaller shape (fewer layers, a smaller hidden size, intermediate size or vocabulary) or a machine with more memory"
    host = available_memory()
    if host is not None and estimate.host_bytes > host:
        raise SpecDecError(
            f"{shape.flag} {shape.name!r} is too big for this machine: building {sizes} needs about {_gb(estimate.host_bytes)} of memory "
            f"at its peak ({estimate.host_phase}), and {_gb(host)} is available; {fix}"
        )
    free = available_device_memory(device)
    if free is not None and estimate.device_bytes > free:
        raise SpecDecError(
            f"{shape.flag} {shape.name!r} is too big for {device}: building {sizes} needs about {_gb(estimate.device_bytes)} of GPU memory "
            f"at its peak ({estimate.device_phase}), and {_gb(free)} is free; {fix}, or --device cpu"
        )


def build_target(
    spec: TargetSpec, root: Path, device: str | torch.device | None = None, log: Log = _quiet, calibration: Calibration = CALIBRATION,
    draft_layers: int = 1,
) -> PairRecord:
    """Build the target into root/target (+ root/prompts.jsonl, root/calibration.safetensors,
    root/synth_pair.json); returns its record. Refuses, before creating root, a shape whose
    target and a `draft_layers`-layer draft cannot be built in the memory available (`check_memory`)."""
    spec.validate()
    shape = load_shape(spec.shape)
    config, notes = target_config(shape, spec.dtype)
    layers = num_layers(config)
    vocab = _vocab(config)
    _check_positions(config, spec.prompt_tokens, calibration)
    plans, head_name = plan_tensors(meta_model(config))  # fails early on an unsupported architecture
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    check_memory(shape, estimate_memory(config, plans, DTYPES[spec.dtype], spec.prompt_tokens, calibration, draft_layers, dev), dev)
    root.mkdir(parents=True, exist_ok=True)

    log(f"{shape.name}: generating {2 * calibration.sequences} x {calibration.new_tokens} calibration tokens with the first-layer model")
    reference, head_plan = build_reference(config, spec.seed, dev)
    both = torch.cat([random_prompts(vocab, calibration.sequences, spec.prompt_tokens, spec.seed, s) for s in ("fit", "check")])
    contexts = decode_contexts(reference, both, calibration.new_tokens)
    del reference
    half = calibration.sequences * calibration.new_tokens
    fit_hidden, check_hidden = contexts.hidden[:half], contexts.hidden[half:]
    saved = DTYPES[spec.dtype]
    step = _block_rows(head_plan)
    if spec.head_scale is None:
        _, clean, _ = _heads(spec.seed, head_plan, 1.0, saved)
        sample = fit_hidden[:: max(1, fit_hidden.shape[0] // HEAD_SCALE_POSITIONS)]
        a0 = torch.cat([sample @ clean(a, b).to(sample.device).T for a, b in _blocks(vocab, step)], dim=-1)  # [n, V]
        head_scale = fit_head_scale(a0)
        del a0
    else:
        head_scale = float(spec.head_scale)
    target_rows, _, _ = _heads(spec.seed, head_plan, head_scale, saved)
    _, top1 = head_argmax(check_hidden, target_rows, vocab, step)
    log(f"head scale {head_scale:.3g}{' (auto)' if spec.head_scale is None else ''}: target mean top-1 probability {float(top1.mean()):.3f}")

    save_file(
        {
            "fit_ids": contexts.ids[: calibration.sequences].contiguous(),
            "fit_hidden": fit_hidden.cpu().contiguous(),
            "check_ids": contexts.ids[calibration.sequences :].contiguous(),
            "check_hidden": check_hidden.cpu().contiguous(),
        },
        str(root / CALIBRATION_FILE),
    )
    write_prompts(root / PROMPTS_FILE, vocab, spec.prompt_tokens, spec.seed)

    log(f"writing the target ({layers} layers, {spec.dtype}) to {root / 'target'}")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for plan in plans:
            yield plan.name, make_tensor(spec.seed, plan, saved, head_scale=head_scale)

    params = write_model(root / "target", config, tensors(), vocab)
    info = TargetInfo(
        shape=shape.name,
        source=shape.source,
        model_type=config.model_type,
        dims=_dims(config),
        dtype=spec.dtype,
        seed=spec.seed,
        head_scale=head_scale,
        head_scale_auto=spec.head_scale is None,
        target_top1=float(top1.mean()),
        params=params,
        prompt_tokens=spec.prompt_tokens,
        calibration={"sequences": calibration.sequences, "new_tokens": calibration.new_tokens, "positions": half},
        notes=notes,
    )
    record = PairRecord(target=info)
    record.save(root)
    return record


def write_prompts(path: Path, vocab: int, length: int, seed: int, count: int = PROMPT_SET_SIZE) -> Path:
    """prompts.jsonl: `count` random-token prompts (not the calibration ones), one {"id", "prompt"} per line."""
    ids = random_prompts(vocab, count, length, seed, "bench")
    lines = [json.dumps({"id": f"random-{i}", "prompt": ids_to_text(row.tolist())}) for i, row in enumerate(ids)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def build_draft(root: Path, draft: DraftSpec, name: str = "draft", device: str | torch.device | None = None, log: Log = _quiet) -> DraftInfo:
    """Build a draft of the target in `root` into root/<name>, calibrated to `draft.agreement`;
    records it in root/synth_pair.json and returns its record."""
    record = read_record(root)
    if record is None:
        raise SpecDecError(f"{root} holds no synthetic target (no complete {PAIR_FILE}); build one with `specdec synth-pair`")
    info = record.target
    config = AutoConfig.from_pretrained(root / "target")
    saved = DTYPES[info.dtype]
    config.dtype = saved
    draft.validate(num_layers(config))
    vocab = _vocab(config)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    draft_config = with_layers(config, draft.draft_layers)
    plans, head_name = plan_tensors(meta_model(draft_config))
    head_plan = next(p for p in plans if p.name == head_name)
    step = _block_rows(head_plan)
    calib = load_file(str(root / CALIBRATION_FILE))
    fit_hidden = calib["fit_hidden"].to(dev)
    target_rows, clean, noise = _heads(info.seed, head_plan, info.head_scale, saved)
    target_arg, _ = head_argmax(fit_hidden, target_rows, vocab, step)
    critical = critical_noise(fit_hidden, target_arg, clean, noise, vocab, step)
    sigma, fit_agreement = noise_for_agreement(critical, draft.agreement)
    log(f"noise std {sigma:.4g}: agreement {fit_agreement:.3f} on {fit_hidden.shape[0]} fit positions (requested {draft.agreement:g})")

    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for plan in plans:
            yield plan.name, make_tensor(info.seed, plan, saved, head_scale=info.head_scale, noise_std=sigma)

    params = write_model(folder, draft_config, tensors(), vocab)
    if info.params <= FULL_CHECK_MAX_PARAMS:
        measured = measure_full(root / "target", folder, calib["check_ids"], info.prompt_tokens, dev)
    else:
        check_hidden = calib["check_hidden"].to(dev)
        target_check, _ = head_argmax(check_hidden, target_rows, vocab, step)

        def draft_rows(a: int, b: int) -> torch.Tensor:
            return head_rows(info.seed, head_plan, info.head_scale, sigma, a, b).to(saved).float()

        draft_check, top1 = head_argmax(check_hidden, draft_rows, vocab, step)
        measured = Measured(
            agreement=float((draft_check == target_check).float().mean()), draft_top1=float(top1.mean()), positions=int(check_hidden.shape[0]),
            method="first layer + heads",
        )
    log(f"achieved agreement {measured.agreement:.3f} on {measured.positions} held-out decode positions ({measured.method})")
    entry = DraftInfo(
        folder=name,
        agreement_requested=float(draft.agreement),
        agreement_achieved=measured.agreement,
        agreement_fit=fit_agreement,
        noise_std=sigma,
        draft_layers=draft.draft_layers,
        params=params,
        draft_top1=measured.draft_top1,
        measured_with=measured.method,
        check_positions=measured.positions,
    )
    record = read_record(root) or record
    record.drafts[name] = entry
    record.save(root)
    return entry


@dataclass
class Measured:
    """A draft's greedy agreement measured on the held-out decode positions."""

    agreement: float
    draft_top1: float
    """the draft's mean top-1 probability (temperature 1)"""
    positions: int
    method: str
    """'full models' (saved target and draft run whole) or 'first layer + heads' (the cheap method)"""


def measure_full(target_dir: Path, draft_dir: Path, ids: torch.Tensor, prompt_tokens: int, device: torch.device, rows: int = 4) -> Measured:
    """Agreement of the saved draft with the saved target, both loaded in float32 and run whole
    on the held-out contexts `ids` [S, P + N] (`rows` sequences at a time), at their decode
    positions; also checks that the target follows its first layer's greedy tokens (the
    construction works for this architecture)."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).to(device).eval()
    agree = follow = positions = 0
    top1_sum = 0.0
    with torch.inference_mode():
        for start in range(0, ids.shape[0], rows):
            batch = ids[start : start + rows].to(device)  # [r, P + N]
            mask = torch.ones_like(batch)
            target_arg = target(input_ids=batch, attention_mask=mask).logits[:, prompt_tokens - 1 : -1].argmax(dim=-1)  # [r, N]
            draft_logits = draft(input_ids=batch, attention_mask=mask).logits[:, prompt_tokens - 1 : -1].float()  # [r, N, V]
            agree += int((draft_logits.argmax(dim=-1) == target_arg).sum())
            follow += int((target_arg == batch[:, prompt_tokens:]).sum())
            top1_sum += float(torch.softmax(draft_logits, dim=-1).max(dim=-1).values.sum())
            positions += target_arg.numel()
    if follow < 0.99 * positions:
        raise SpecDecError(
            f"the saved target follows its first layer's greedy tokens at only {follow / positions:.1%} of positions; zeroing "
            f"{', '.join(sorted(OUTPUT_PROJECTIONS))} does not reduce this architecture's later layers to the identity"
        )
    return Measured(agreement=agree / positions, draft_top1=top1_sum / positions, positions=positions, method="full models")


# ----- entry points ----------------------------------------------------------------------


def synth_pair(spec: TargetSpec, draft: DraftSpec, out: Path, device: str | torch.device | None = None, log: Log = _quiet) -> PairRecord:
    """`specdec synth-pair`: a target and one draft in `out` (out/target, out/draft,
    out/prompts.jsonl, out/synth_pair.json)."""
    spec.validate()
    draft.validate()
    shape = load_shape(spec.shape)
    config, _ = target_config(shape, spec.dtype)
    draft.validate(num_layers(config))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecDecError(f"--out {str(out)!r} exists and is not an empty folder; give a new folder (or delete it)")
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the first folder this call creates
    try:
        build_target(spec, out, device, log, draft_layers=draft.draft_layers)
        build_draft(out, draft, "draft", device, log)
    except BaseException:
        # no half-built pair (or empty folder) is left behind: remove what this call created
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif out.is_dir():
            for child in out.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        raise
    record = read_record(out)
    assert record is not None
    return record


def cache_key(spec: TargetSpec) -> str:
    """The cache folder name of a target: shape label + a hash of everything that defines it."""
    shape = load_shape(spec.shape)
    payload = json.dumps(
        {"config": shape.config, "dtype": spec.dtype, "seed": spec.seed, "head_scale": spec.head_scale, "prompt_tokens": spec.prompt_tokens, "format": FORMAT_VERSION},
        sort_keys=True,
    )
    named = (SHAPES_DIR / f"{spec.shape}.json").is_file()
    label = spec.shape if named else "config-" + re.sub(r"[^A-Za-z0-9._-]+", "-", Path(shape.name).parent.name or "file")
    return f"{label}-{hashlib.sha256(payload.encode()).hexdigest()[:10]}"


def draft_folder_name(draft: DraftSpec) -> str:
    return f"draft-a{draft.agreement:g}-l{draft.draft_layers}"


def cached_target(spec: TargetSpec, cache: Path, device: str | torch.device | None = None, log: Log = _quiet) -> Path:
    """The folder of `spec`'s target in `cache`, built when missing (or incomplete)."""
    spec.validate()
    root = cache / cache_key(spec)
    if read_record(root) is None:
        if root.exists():
            shutil.rmtree(root)
        log(f"building the synthetic target in {root}")
        build_target(spec, root, device, log)
    else:
        log(f"synthetic target cached in {root}")
    return root


def cached_draft(root: Path, draft: DraftSpec, device: str | torch.device | None = None, log: Log = _quiet) -> tuple[Path, DraftInfo]:
    """A draft folder of the target in `root` for `draft`, built when missing."""
    name = draft_folder_name(draft)
    record = read_record(root)
    if record is not None and name in record.drafts and (root / name / "config.json").is_file():
        return root / name, record.drafts[name]
    log(f"building the draft for agreement {draft.agreement:g} ({draft.draft_layers} layer(s))")
    return root / name, build_draft(root, draft, name, device, log)
