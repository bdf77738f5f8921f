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
from typing import Any, Protocol

import torch
from PIL import Image
from transformers import PreTrainedModel

from specdec.errors import SpecDecError
from specdec.multimodal.inputs import IMAGE_PLACEHOLDER, MultimodalPrompt, batch_model_inputs, encode_multimodal, image_token_id

Encoded = tuple[list[int], dict[str, Any]]
"""(token ids, extra prefill inputs) of one prompt"""


class PromptView(Protocol):
    name: str

    def encode(self, prompt: Sequence[int]) -> Encoded:
        """The draft's token ids and prefill inputs for `prompt`."""
        ...


def encode_batch(view: PromptView, prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Left-padded ids [B, L], mask [B, L] and the batched prefill inputs of `prompts` seen through `view`."""
    encoded = [view.encode(p) for p in prompts]
    return left_pad([ids for ids, _ in encoded], device) + (merge_inputs([extra for _, extra in encoded], device),)


def left_pad(seqs: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq) == 0:
            raise SpecDecError(f"a drafting view produced an empty prompt for row {row}")
        ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def merge_inputs(per_prompt: Sequence[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Batch per-prompt prefill inputs (row order); precomputed image features become the
    model's `mm_encoder_outputs`."""
    features = [f for extra in per_prompt for f in extra.get("image_features", [])]
    plain = [MultimodalPrompt(token_ids=[0], model_inputs={k: v for k, v in extra.items() if k != "image_features"}) for extra in per_prompt]
    merged = batch_model_inputs(plain, device)
    if features:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        merged["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=[f.to(device) for f in features])}
    return merged


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
    """T: every `<image>` replaced by `replacement` (a newline, as in the TABED paper)."""

    name = "T"

    def __init__(self, tokenizer: Any, replacement: str = "\n") -> None:
        self.tokenizer = tokenizer
        self.replacement = replacement

    def encode(self, prompt: Sequence[int]) -> Encoded:
        if not isinstance(prompt, MultimodalPrompt):
            return list(prompt), {}
        text = prompt.text.replace(IMAGE_PLACEHOLDER + "\n", self.replacement).replace(IMAGE_PLACEHOLDER, self.replacement)
        return self.tokenizer(text)["input_ids"], {}


Captioner = Callable[[Image.Image], str]


class CaptionView:
    """C: every `<image>` replaced by "image: <caption>" (captions cached per image)."""

    name = "C"

    def __init__(self, tokenizer: Any, captioner: Captioner, prefix: str = "image: ") -> None:
        self.tokenizer = tokenizer
        self.captioner = captioner
        self.prefix = prefix
        self._captions: dict[int, str] = {}

    def caption(self, image: Image.Image) -> str:
        key = id(image)
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
