"""Prompts with images for LLaVA-family models, and what a model needs to prefill them.

A LLaVA-family model (`LlavaForConditionalGeneration` and models sharing its interface)
reads a prompt whose `<image>` placeholders its processor expands to one image token per
image feature, plus `pixel_values`. Prefill passes those pixel values once; after that,
decoding only appends text tokens, so the whole tree/verify/commit machinery is unchanged.

`MultimodalPrompt` behaves as the sequence of its token ids (so length checks, padding and
n-gram lookup work as for text) and carries the processor's other outputs
(`model_inputs`) plus the original text and images, from which drafting views (text only,
caption, pooled image) are built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.errors import SpecDecError
from specdec.extras import require

if TYPE_CHECKING:
    from PIL import Image

IMAGE_PLACEHOLDER = "<image>"
"""the placeholder a prompt's text uses for each image (LLaVA convention)"""


@dataclass(eq=False)
class MultimodalPrompt(Sequence[int]):
    """A prompt with images, encoded for one model family (its processor)."""

    token_ids: list[int]
    """the processor's input ids: each placeholder expanded to the model's image tokens"""
    model_inputs: dict[str, Any] = field(default_factory=dict)
    """the processor's other outputs, e.g. pixel_values [n_images, 3, H, W] (batch dim = images)"""
    text: str = ""
    """the prompt text with `<image>` placeholders"""
    images: list[Image.Image] = field(default_factory=list)
    """the original images, in placeholder order"""

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index):  # type: ignore[override]
        return self.token_ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids)


def is_multimodal(model_or_config: Any) -> bool:
    """True for LLaVA-family models/configs (they have a vision config)."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "vision_config", None) is not None


def image_token_id(model_or_config: Any) -> int | None:
    config = getattr(model_or_config, "config", model_or_config)
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def load_images(images: Sequence[str | Path | Image.Image]) -> list[Image.Image]:
    """Open file paths (or pass PIL images through) as RGB images; errors name the file."""
    require("PIL", "vision", "prompts with images")
    from PIL import Image, UnidentifiedImageError

    loaded = []
    for item in images:
        if isinstance(item, Image.Image):
            loaded.append(item.convert("RGB"))
            continue
        path = Path(item).expanduser()
        if not path.is_file():
            problem = "is a directory" if path.is_dir() else "does not exist"
            raise SpecDecError(f"image {str(item)!r} {problem}; pass a path to a PNG or JPEG file")
        try:
            with Image.open(path) as img:
                loaded.append(img.convert("RGB"))
        except (UnidentifiedImageError, OSError) as err:
            raise SpecDecError(f"image {str(item)!r} could not be read as an image ({err}); pass a PNG or JPEG file") from err
    return loaded


def count_placeholders(text: str) -> int:
    return text.count(IMAGE_PLACEHOLDER)


def check_placeholders(text: str, n_images: int) -> None:
    """Each image needs exactly one `<image>` placeholder in the text, and vice versa."""
    n_slots = count_placeholders(text)
    if n_slots != n_images:
        raise SpecDecError(
            f"the prompt has {n_slots} {IMAGE_PLACEHOLDER} placeholder(s) but {n_images} image(s) were given; "
            f"put one {IMAGE_PLACEHOLDER} in the prompt where each image goes, e.g. \"USER: {IMAGE_PLACEHOLDER}\\nWhat is in the picture? ASSISTANT:\""
        )


def encode_multimodal(processor: Any, text: str, images: Sequence[str | Path | Image.Image]) -> MultimodalPrompt:
    """Run a LLaVA-family processor on one prompt and its images."""
    pil_images = load_images(images)
    check_placeholders(text, len(pil_images))
    try:
        out = processor(text=text, images=pil_images or None, return_tensors="pt")
    except (ValueError, TypeError) as err:
        raise SpecDecError(f"the processor could not encode the prompt with {len(pil_images)} image(s): {err}") from err
    ids = out["input_ids"][0].tolist()
    model_inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")}
    return MultimodalPrompt(token_ids=ids, model_inputs=model_inputs, text=text, images=pil_images)


BATCHED_IMAGE_MODEL_TYPES = frozenset({
    "llava", "llava_next", "llava_onevision", "llava_next_video", "video_llava", "vipllava", "mistral3", "aya_vision", "internvl",
    "idefics2", "idefics3", "smolvlm", "aria", "cohere2_vision", "deepseek_vl", "deepseek_vl_hybrid", "deepseek_ocr2", "got_ocr2",
    "janus", "lfm2_vl", "lighton_ocr", "ovis2", "exaone4_5", "hyperclovax_vision_v2", "minimax_m3_vl", "muse_glimmer",
    "pp_chart2table", "qianfan_ocr", "kimi_k25", "step3p7", "video_llama_3",
})
"""vision-language model types whose prefill takes a batch's images concatenated in row order
(`batch_model_inputs`) and gives each row what its prompt alone gives: LLaVA and LLaVA-NeXT in
tests/test_multimodal.py, the rest at batch size 2 in the image sweep of 2026-11-26
(benchmarks/architecture-sweep/images.md). Other models get each prompt with images prefilled in
a forward of its own (`prefill_inputs`): the sweep found batches that need other padding values
(Gemma 4 marks padded patches with -1, not 0), index offsets (Molmo 2's pooling indices point
into the whole batch's patches) or that read zero padding as image content (Emu3, Fuyu)."""


def prefill_inputs(prompts: Sequence[Sequence[int]], device: torch.device | None, model: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """The extra prefill inputs of a batch of prompts for `model`: one dict for the whole batch
    (`batch_model_inputs`) when the model batches images exactly (`BATCHED_IMAGE_MODEL_TYPES`)
    or the batch is one prompt; otherwise one dict per row ({} for text rows), which
    `ModelRunner.prefill` runs a row at a time. {} for an all-text batch."""
    rows = [dict(p.model_inputs) if isinstance(p, MultimodalPrompt) else {} for p in prompts]
    if not any(rows):
        return {}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if len(rows) == 1 or model_type in BATCHED_IMAGE_MODEL_TYPES:
        return batch_model_inputs(prompts, device)
    return [{k: v.to(device) if isinstance(v, torch.Tensor) and device is not None else v for k, v in row.items()} for row in rows]


def batch_model_inputs(prompts: Sequence[Sequence[int]], device: torch.device | None = None) -> dict[str, Any]:
    """The extra prefill inputs of a batch of prompts, in row order (images concatenated).

    LLaVA-family models scatter image features into the image tokens of the flattened
    [B, L] ids in order, so concatenating each row's images in row order is exact.
    Tensors that differ beyond their first dimension (LLaVA-NeXT's pixel values
    [images, patches, 3, H, W] have as many patches as each image's aspect ratio needs) are
    zero-padded at the end of each dimension first, as the processors pad a batch they encode
    together: the model reads only the real part (LLaVA-NeXT counts an image's patches from its
    `image_sizes`). Text-only prompts contribute nothing; an all-text batch gives {}.
    """
    merged: dict[str, list[Any]] = {}
    for prompt in prompts:
        if isinstance(prompt, MultimodalPrompt):
            for key, value in prompt.model_inputs.items():
                merged.setdefault(key, []).append(value)
    batch: dict[str, Any] = {}
    for key, values in merged.items():
        if all(isinstance(v, torch.Tensor) for v in values):
            if len({v.dim() for v in values}) != 1:
                raise SpecDecError(
                    f"the prompts' {key!r} inputs have different ranks ({sorted({v.dim() for v in values})} dimensions): they were encoded "
                    "by different processors; encode every prompt of a batch with the target's processor (encode_multimodal)"
                )
            tensor = torch.cat(_padded_alike(values), dim=0)
            batch[key] = tensor.to(device) if device is not None else tensor
        elif all(isinstance(v, list) for v in values):
            batch[key] = [item for v in values for item in v]
        else:
            batch[key] = values
    return batch


def _padded_alike(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors zero-padded at the end of every dimension but the first to the largest size
    there (unchanged when they already agree). The tensors have one rank."""
    if len({t.shape[1:] for t in tensors}) == 1:
        return tensors
    target = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = []
    for t in tensors:
        pad: list[int] = []
        for d in reversed(range(1, t.dim())):  # F.pad lists the last dimension first
            pad += [0, target[d - 1] - t.shape[d]]
        out.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return out


def same_image_encoding(target: Any, draft: Any, target_processor: Any, draft_processor: Any) -> bool:
    """True when the draft can reuse the target's encoding of a prompt with images: same
    image token, same number of image tokens per image, same image preprocessing."""
    if image_token_id(target) != image_token_id(draft):
        return False
    if getattr(target.config, "image_seq_length", None) != getattr(draft.config, "image_seq_length", None):
        return False
    t_img = getattr(target_processor, "image_processor", None)
    d_img = getattr(draft_processor, "image_processor", None)
    if t_img is None or d_img is None:
        return t_img is d_img
    return t_img.to_dict() == d_img.to_dict()
