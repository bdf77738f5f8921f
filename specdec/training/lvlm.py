"""Tiny LLaVA-style vision-language models: configs, tokenizer and processor.

Both models are `LlavaForConditionalGeneration`: a CLIP vision tower, a two-layer MLP
projector and a Llama language model. Target and draft read images the same way (same
image size and patch grid, so the same number of image tokens per image) and share one
tokenizer, so one processor encodes prompts for both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor, PreTrainedTokenizerFast

from specdec.errors import SpecDecError
from specdec.multimodal.inputs import IMAGE_PLACEHOLDER
from specdec.training.tokenizer import bpe_tokenizer

EOS = "</s>"
PAD = "<pad>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %} "
    "{% elif message['role'] == 'assistant' %}ASSISTANT: {{ message['content'] if message['content'] is string else message['content'][0]['text'] }}</s>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""LLaVA-1.5's conversation format: `USER: <image>\\nQ ASSISTANT: A</s>USER: ...`"""


@dataclass(frozen=True)
class LvlmSize:
    """The sizes of one tiny LVLM."""

    vision_hidden: int
    vision_layers: int
    vision_heads: int
    text_hidden: int
    text_layers: int
    text_heads: int
    image_size: int = 96
    patch_size: int = 16
    max_positions: int = 1024

    @property
    def image_tokens(self) -> int:
        """image tokens per image: the patch grid (the CLS token is dropped)"""
        return (self.image_size // self.patch_size) ** 2


TARGET_SIZE = LvlmSize(vision_hidden=192, vision_layers=4, vision_heads=4, text_hidden=320, text_layers=6, text_heads=5)
DRAFT_SIZE = LvlmSize(vision_hidden=64, vision_layers=1, vision_heads=2, text_hidden=128, text_layers=1, text_heads=2)


def lvlm_config(size: LvlmSize, tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    """A `LlavaConfig` of `size` for `tokenizer` (which must have `<image>`, EOS and pad tokens)."""
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    if image_id is None or image_id == tokenizer.unk_token_id:
        raise SpecDecError(f"the tokenizer has no {IMAGE_PLACEHOLDER} token; train it with train_lvlm_tokenizer")
    vision = CLIPVisionConfig(
        hidden_size=size.vision_hidden,
        intermediate_size=4 * size.vision_hidden,
        num_hidden_layers=size.vision_layers,
        num_attention_heads=size.vision_heads,
        image_size=size.image_size,
        patch_size=size.patch_size,
        projection_dim=size.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.text_hidden,
        intermediate_size=int(8 / 3 * size.text_hidden) // 16 * 16,
        num_hidden_layers=size.text_layers,
        num_attention_heads=size.text_heads,
        num_key_value_heads=size.text_heads,
        max_position_embeddings=size.max_positions,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        image_seq_length=size.image_tokens,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def train_lvlm_tokenizer(texts: Iterable[str], out_dir: Path | None = None, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `</s>` (EOS), `<pad>` and `<image>` as special tokens."""
    tokenizer = bpe_tokenizer(texts, vocab_size, EOS, PAD, max_length=1024, image_token=IMAGE_PLACEHOLDER)
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out_dir)
    return tokenizer


def make_processor(tokenizer: PreTrainedTokenizerFast, size: LvlmSize) -> LlavaProcessor:
    """A `LlavaProcessor` that resizes images to `size.image_size` and expands each `<image>`
    into `size.image_tokens` image tokens (`AutoProcessor.from_pretrained` reloads it)."""
    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor  # no torchvision needed
    except ImportError:  # pragma: no cover - older transformers
        from transformers import CLIPImageProcessor as ImageProcessor
    image_processor = ImageProcessor(
        size={"shortest_edge": size.image_size},
        crop_size={"height": size.image_size, "width": size.image_size},
        do_center_crop=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=size.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def size_dict(size: LvlmSize) -> dict[str, Any]:
    return asdict(size) | {"image_tokens": size.image_tokens}
