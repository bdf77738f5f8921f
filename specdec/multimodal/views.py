"""Drafting views: how a draft model sees a prompt (TABED's M, T, C and P views).

A view turns a prompt into the draft's own token ids and prefill inputs. Text-only prompts
(plain token-id lists) pass through every view unchanged, so views also work for text
models. For a `MultimodalPrompt`:

- `FullView` (M): the image and the text, as the draft's processor encodes them (or the
  target's encoding itself when both models read images the same way).
- `TextOnlyView` (T): each `<image>` replaced by a newline, as in the TABED paper.
- `CaptionView` (C): each `<image>` replaced by "image: " and a caption of that image,
  produced once per image by a captioner (by default the draft LVLM itself).
- `PooledImageView` (P): image features average-pooled 2x2 before the projector, so each
  image costs a quarter of the tokens.
- `TruncatedView`: the last N tokens of a text prompt (a second view for text drafts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel

from specdec.errors import SpecDecError
from specdec.multimodal.inputs import IMAGE_PLACEHOLDER, MultimodalPrompt, encode_multimodal, image_token_id, prefill_inputs
from specdec.padding import pad_rows

if TYPE_CHECKING:
    from PIL import Image

Encoded = tuple[list[int], dict[str, Any]]
"""(token ids, extra prefill inputs) of one prompt"""


class PromptView(Protocol):
    name: str

    def encode(self, prompt: Sequence[int]) -> Encoded:
        """The draft's token ids and prefill inputs for `prompt`."""
        ...


def encode_batch(
    view: PromptView, prompts: Sequence[Sequence[int]], device: torch.device, model: PreTrainedModel | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any] | list[dict[str, Any]]]:
    """Left-padded ids [B, L], mask [B, L] and the batched prefill inputs of `prompts` seen through `view`."""
    encoded = [view.encode(p) for p in prompts]
    return left_pad([ids for ids, _ in encoded], device) + (merge_inputs([extra for _, extra in encoded], device, model),)


def left_pad(seqs: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, L] and mask of the views' encodings; an empty one is an error."""
    for row, seq in enumerate(seqs):
        if len(seq) == 0:
            raise SpecDecError(f"a drafting view produced an empty prompt for row {row}")
    ids, mask = pad_rows(seqs, pad_id, side="left")
    return ids.to(device), mask.to(device)


def merge_inputs(per_prompt: Sequence[dict[str, Any]], device: torch.device, model: PreTrainedModel | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    """Batch per-prompt prefill inputs (row order); for a model whose images do not batch
    exactly (`prefill_inputs`), one dict per row.

    Views that precompute image features (P) give `image_features`; they become the model's
    `mm_encoder_outputs`. A model takes either pixel values or precomputed features per
    forward, so when a batch mixes both, the pixel values are turned into features with
    `model.get_image_features` (the same computation the model would do), in row order.
    """
    has_features = any("image_features" in extra for extra in per_prompt)
    has_pixels = any("pixel_values" in extra for extra in per_prompt)
    if not has_features:
        plain = [MultimodalPrompt(token_ids=[0], model_inputs=dict(extra)) for extra in per_prompt]
        return prefill_inputs(plain, device, model)
    if has_pixels and model is None:
        raise SpecDecError("a batch mixing pooled-image rows and full-image rows needs the draft model to compute image features")
    features: list[torch.Tensor] = []
    for extra in per_prompt:
        if "image_features" in extra:
            features.extend(f.to(device) for f in extra["image_features"])
        elif "pixel_values" in extra:
            assert model is not None
            with torch.inference_mode():
                out = model.get_image_features(pixel_values=extra["pixel_values"].to(device, next(model.parameters()).dtype))
            features.extend(out.pooler_output)
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=features)}}


class PassThroughView:
    """The target's own encoding (same ids, same pixel values)."""

    name = "M"

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if isinstance(prompt, MultimodalPrompt):
            return list(prompt.token_ids), dict(prompt.model_inputs)
        return list(prompt), {}


class FullView:
    """M: image and text through the draft's own processor (its image-token count may differ from the target's)."""

    name = "M"

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if not isinstance(prompt, MultimodalPrompt):
            return list(prompt), {}
        enc = encode_multimodal(self.processor, prompt.text, prompt.images)
        return enc.token_ids, enc.model_inputs


class TextOnlyView:
    """T: every `<image>` replaced by `replacement` (a newline, as in the TABED paper, Section
    I.2: the placeholder alone is replaced, so `<image>\\n` becomes two newlines and the prompt
    keeps its length in tokens)."""

    name = "T"

    def __init__(self, tokenizer: Any, replacement: str = "\n") -> None:
        self.tokenizer = tokenizer
        self.replacement = replacement

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if not isinstance(prompt, MultimodalPrompt):
            return list(prompt), {}
        text = prompt.text.replace(IMAGE_PLACEHOLDER, self.replacement)
        return self.tokenizer(text)["input_ids"], {}


Captioner = Callable[["Image.Image"], str]


class CaptionView:
    """C: every `<image>` replaced by "image: <caption>" (captions cached per image)."""

    name = "C"

    def __init__(self, tokenizer: Any, captioner: Captioner, prefix: str = "image: ") -> None:
        self.tokenizer = tokenizer
        self.captioner = captioner
        self.prefix = prefix
        self._captions: dict[str, str] = {}

    def caption(self, image: Image.Image) -> str:
        import hashlib

        key = hashlib.sha1(image.tobytes() + repr(image.size).encode()).hexdigest()
        if key not in self._captions:
            self._captions[key] = self.captioner(image).strip()
        return self._captions[key]

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if not isinstance(prompt, MultimodalPrompt):
            return list(prompt), {}
        pieces = prompt.text.split(IMAGE_PLACEHOLDER)
        text = pieces[0]
        for image, piece in zip(prompt.images, pieces[1:], strict=True):
            text += f"{self.prefix}{self.caption(image)}" + ("" if piece.startswith("\n") else "\n") + piece
        return self.tokenizer(text)["input_ids"], {}


def takes_encoder_outputs(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes precomputed image features as `mm_encoder_outputs`.
    Older transformers (5.17, say) take **kwargs and would drop them without a word: the draft
    would then see its image tokens' plain embeddings, not the image."""
    import inspect

    try:
        return "mm_encoder_outputs" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class PooledImageView:
    """P: the draft's image features average-pooled `pool`x`pool` before its projector.

    Needs a LLaVA-style model (`model.model.vision_tower` + `multi_modal_projector`, square
    patch grid); each image then takes (grid/pool)^2 image tokens instead of grid^2.
    """

    name = "P"

    def __init__(self, model: PreTrainedModel, processor: Any, pool: int = 2) -> None:
        inner = getattr(model, "model", model)
        if not hasattr(inner, "vision_tower") or not hasattr(inner, "multi_modal_projector"):
            raise SpecDecError(f"the pooled-image view needs a LLaVA-style draft (vision_tower + multi_modal_projector); {type(model).__name__} has none")
        if pool < 1:
            raise SpecDecError(f"pool={pool} must be a positive integer")
        if not takes_encoder_outputs(inner):
            import transformers

            raise SpecDecError(
                f"the pooled-image view (P) hands the draft precomputed image features, which {type(inner).__name__}.forward "
                f"takes as `mm_encoder_outputs` from a later transformers than the installed {transformers.__version__} "
                "(5.24 has it); upgrade transformers, or use views without P (e.g. --views M,T)"
            )
        self.model = model
        self.inner = inner
        self.processor = processor
        self.pool = pool
        self.image_token = image_token_id(model)

    @torch.inference_mode()
    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, H, W] -> pooled projected features [n, (g/pool)^2, D]."""
        cfg = self.model.config
        dev = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        out = self.inner.vision_tower(pixel_values.to(dev, dtype), output_hidden_states=True, return_dict=True)
        layer = cfg.vision_feature_layer if isinstance(cfg.vision_feature_layer, int) else cfg.vision_feature_layer[-1]
        hidden = out.hidden_states[layer]  # [n, 1 + g*g, d] (CLS first)
        if cfg.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        n, tokens, d = hidden.shape
        grid = int(round(tokens**0.5))
        if grid * grid != tokens or grid % self.pool:
            raise SpecDecError(f"the pooled-image view needs a square patch grid divisible by {self.pool}; the draft has {tokens} patches")
        grid_features = hidden.reshape(n, grid, grid, d).permute(0, 3, 1, 2)  # [n, d, g, g]
        pooled = torch.nn.functional.avg_pool2d(grid_features, self.pool).flatten(2).transpose(1, 2)  # [n, (g/p)^2, d]
        return self.inner.multi_modal_projector(pooled)

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if not isinstance(prompt, MultimodalPrompt):
            return list(prompt), {}
        enc = encode_multimodal(self.processor, prompt.text, prompt.images)
        feats = self.features(enc.model_inputs["pixel_values"])  # [n_images, k, D]
        k = feats.shape[1]
        per_image = sum(tok == self.image_token for tok in enc.token_ids) // max(1, feats.shape[0])
        ids: list[int] = []
        run = 0
        for tok in enc.token_ids:  # keep the first k of each image's `per_image` tokens
            if tok == self.image_token:
                run += 1
                if (run - 1) % per_image < k:
                    ids.append(tok)
            else:
                run = 0
                ids.append(tok)
        return ids, {"image_features": list(feats)}


class TruncatedView:
    """The last `tokens` tokens of the prompt (of its text-only view for prompts with images):
    a second view for text drafts (e.g. recent context only)."""

    def __init__(self, tokens: int, tokenizer: Any = None) -> None:
        if not isinstance(tokens, int) or tokens < 1:
            raise SpecDecError(f"a truncated view needs a positive token count, got {tokens!r}")
        self.tokens = tokens
        self.text_view = TextOnlyView(tokenizer) if tokenizer is not None else None
        self.name = f"tail{tokens}"

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if isinstance(prompt, MultimodalPrompt):
            if self.text_view is None:
                raise SpecDecError("a truncated view of a prompt with images needs the tokenizer")
            ids, _ = self.text_view.encode(prompt)
        else:
            ids = list(prompt)
        return ids[-self.tokens :], {}


class ModelCaptioner:
    """Captions an image with a LLaVA-family model (greedy, short): the C view's captioner."""

    def __init__(self, model: PreTrainedModel, processor: Any, instruction: str = "USER: <image>\nDescribe the image. ASSISTANT:", max_new_tokens: int = 40) -> None:
        self.model = model
        self.processor = processor
        self.instruction = instruction
        self.max_new_tokens = max_new_tokens
        self.seconds = 0.0
        """wall time spent captioning"""

    @torch.inference_mode()
    def __call__(self, image: Image.Image) -> str:
        import time

        t0 = time.perf_counter()
        enc = encode_multimodal(self.processor, self.instruction, [image])
        dev = next(self.model.parameters()).device
        ids = torch.tensor([enc.token_ids], device=dev)
        extra = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in enc.model_inputs.items()}
        tok = self.processor.tokenizer
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=self.max_new_tokens, do_sample=False,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
        self.seconds += time.perf_counter() - t0
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


VIEW_NAMES = ("M", "T", "C", "P")
"""the TABED views; `tailN` (e.g. tail64) adds a truncated-context view"""


def parse_views(spec: str | Sequence[str]) -> list[str]:
    """'M,T,C,P' -> ['M', 'T', 'C', 'P'] (checked; tailN allowed)."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise SpecDecError("--views is empty; name at least one of M, T, C, P (or tailN)")
    for name in names:
        if name not in VIEW_NAMES and not (name.startswith("tail") and name[4:].isdigit() and int(name[4:]) > 0):
            raise SpecDecError(f"view {name!r} is not known; use M (image+text), T (text only), C (caption), P (pooled image) or tailN (last N tokens)")
    if len(set(names)) != len(names):
        raise SpecDecError(f"--views {','.join(names)} names a view twice")
    return names
