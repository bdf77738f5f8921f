"""Vision-language (LLaVA-family) targets and drafts: greedy output equals the target's own
`generate` with the same images, batched and rolling; drafting views; input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import LVLM_TEXTS as TEXTS
from conftest import SIZE_D, SIZE_T
from conftest import lvlm_image as _image
from PIL import Image

from specdec.api import SpeculativeDecoder
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.multimodal.inputs import MultimodalPrompt, encode_multimodal
from specdec.multimodal.views import PassThroughView, PooledImageView, TextOnlyView, takes_encoder_outputs
from specdec.sources import ModelDraftSource
from specdec.training.lvlm import make_processor
from specdec.verification import GreedyRule

METHODS = {
    "ar": {},
    "chain": {"k": 4},
    "static": {"depth": 3, "branching": 2, "max_nodes": 12},
    "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10},
    "dynatree": {"d0": 3, "d_max": 5, "max_nodes": 12},
}


def reference(target, prompt, max_new: int, eos: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    extra = prompt.model_inputs if isinstance(prompt, MultimodalPrompt) else {}
    with torch.no_grad():
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=1)
    return out[0, ids.shape[1] :].tolist()


def engine(lvlm, method: str, draft=None, view=None) -> SpeculativeEngine:
    draft = lvlm["draft"] if draft is None else draft
    return SpeculativeEngine(
        lvlm["target"], make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(draft, view=view),
        eos_token_ids=[lvlm["tok"].eos_token_id], pad_token_id=1,
    )


def test_prompt_expands_each_image(lvlm):
    one, two = lvlm["prompts"][:2]
    image_id = lvlm["target"].config.image_token_index
    assert sum(t == image_id for t in one) == SIZE_T.image_tokens
    assert sum(t == image_id for t in two) == 2 * SIZE_T.image_tokens
    assert two.model_inputs["pixel_values"].shape == (2, 3, 32, 32)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_equals_generate_batched_and_rolling(lvlm, method):
    """Every method, a batch mixing one-image, two-image and text-only prompts, decoded all
    at once and with 2 rows (rows retire and new prompts with images are prefilled in)."""
    eos = lvlm["tok"].eos_token_id
    refs = [reference(lvlm["target"], p, 16, eos) for p in lvlm["prompts"]]
    assert refs[0] != refs[3], "different images should give different outputs (the images are read)"
    for batch_size in (None, 2):
        outs = engine(lvlm, method).generate(lvlm["prompts"], 16, batch_size=batch_size)
        assert [o.token_ids for o in outs] == refs, f"{method} batch_size={batch_size}"


def test_text_only_draft_of_a_vision_target(lvlm):
    """A draft that cannot see images drafts from the text-only view; output is unchanged."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(3)
    text_draft = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=len(lvlm["tok"]), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=512)
    ).eval()
    eos = lvlm["tok"].eos_token_id
    refs = [reference(lvlm["target"], p, 12, eos) for p in lvlm["prompts"]]
    view = TextOnlyView(lvlm["tok"])
    outs = engine(lvlm, "chain", draft=text_draft, view=view).generate(lvlm["prompts"], 12)
    assert [o.token_ids for o in outs] == refs
    with pytest.raises(SpecDecError, match="text-only model but the prompts have images"):
        engine(lvlm, "chain", draft=text_draft).generate(lvlm["prompts"], 4)


def test_text_only_view_replaces_each_image_by_a_newline(lvlm):
    ids, extra = TextOnlyView(lvlm["tok"]).encode(lvlm["prompts"][1])
    assert extra == {}
    # the paper (TABED, Section I.2) replaces the placeholder alone: its own newline stays
    assert ids == lvlm["tok"]("USER: \n\n\n\nWhat changed between the two images? ASSISTANT:")["input_ids"]
    assert TextOnlyView(lvlm["tok"]).encode([5, 6, 7]) == ([5, 6, 7], {})


def test_pooled_view_needs_a_transformers_that_takes_encoder_outputs(lvlm, monkeypatch):
    """transformers 5.17's LLaVA forward has no `mm_encoder_outputs` and drops it into **kwargs
    without a word (the draft then sees no image: test_pooled_view failed that way on the GPU
    machine's image). A forward without the parameter is refused with a clear error instead."""
    draft, processor = lvlm["draft"], make_processor(lvlm["tok"], SIZE_D)
    inner = draft.model
    monkeypatch.setattr(inner, "forward", lambda input_ids=None, pixel_values=None, **kwargs: None)
    assert not takes_encoder_outputs(inner)
    with pytest.raises(SpecDecError, match="mm_encoder_outputs.*--views M,T"):
        PooledImageView(draft, processor, pool=2)


def test_pooled_view(lvlm):
    """pool=1 reproduces the full view's draft logits; pool=2 keeps a quarter of the image tokens."""
    draft, processor = lvlm["draft"], make_processor(lvlm["tok"], SIZE_D)
    if not takes_encoder_outputs(draft.model):
        pytest.skip("this transformers takes no precomputed image features (mm_encoder_outputs): the view is refused")
    prompt = lvlm["prompts"][1]
    image_id = draft.config.image_token_index

    def last_logits(view):
        source = ModelDraftSource(draft, view=view)
        source.prefill(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), prompts=[prompt])
        root = torch.tensor([5])
        from specdec.sampling import SamplingParams

        return source.begin_step(root, SamplingParams())

    full = last_logits(PassThroughView())
    same = last_logits(PooledImageView(draft, processor, pool=1))
    assert torch.allclose(full, same, atol=1e-4)
    ids, extra = PooledImageView(draft, processor, pool=2).encode(prompt)
    assert sum(t == image_id for t in ids) == 2 * SIZE_D.image_tokens // 4
    assert len(extra["image_features"]) == 2
    pooled = last_logits(PooledImageView(draft, processor, pool=2))
    assert not torch.allclose(full, pooled, atol=1e-3)


def test_api_with_images(lvlm, tmp_path):
    root: Path = lvlm["root"]
    path = tmp_path / "scene.png"
    _image(0).save(path)
    dec = SpeculativeDecoder.from_pretrained(str(root / "target"), str(root / "draft"), method="chain", device="cpu", k=3)
    assert dec.draft_view() is None  # both read 32px images as 16 tokens: the draft reuses the target's encoding
    result = dec.generate(TEXTS[0], max_new_tokens=10, images=[str(path)])
    ref = reference(lvlm["target"], encode_multimodal(lvlm["processor"], TEXTS[0], [Image.open(path)]), 10, lvlm["tok"].eos_token_id)
    assert result.token_ids == ref
    with pytest.raises(SpecDecError, match="1 <image> placeholder"):
        dec.generate(TEXTS[0], max_new_tokens=4, images=[str(path), str(path)])
    with pytest.raises(SpecDecError, match="does not exist"):
        dec.generate(TEXTS[0], max_new_tokens=4, images=[str(tmp_path / "missing.png")])
    with pytest.raises(SpecDecError, match="is a directory; pass a path"):
        dec.generate(TEXTS[0], max_new_tokens=4, images=[str(tmp_path)])
    with pytest.raises(SpecDecError, match="placeholder"):
        dec.generate(TEXTS[0], max_new_tokens=4)


def test_images_for_a_text_target(tiny_pair_dir, tmp_path):
    path = tmp_path / "scene.png"
    _image(0).save(path)
    dec = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="chain", device="cpu")
    with pytest.raises(SpecDecError, match="text-only model"):
        dec.generate("USER: <image>\nhi", max_new_tokens=4, images=[str(path)])


def test_bench_runs_scenario_prompts_with_images(lvlm, tmp_path):
    """`specdec bench` on a scenario set: images reach the engine and the HF peers, and
    every greedy output equals AR's."""
    import json

    from specdec.cli import main

    root = lvlm["root"]
    args = ["bench", "--prompts", "scenes-second-turn", "--target", str(root / "target"), "--draft", str(root / "draft"), "--device", "cpu",
            "--methods", "ar,hf,chain,eagle2", "--num-prompts", "2", "--max-new-tokens", "5", "--repeats", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    text = json.dumps(results)
    assert "hf" in text and "eagle2" in text
    assert (tmp_path / "report.md").read_text().count("yes") >= 3


def test_pad_rows_left_and_right():
    from specdec.padding import pad_rows

    ids, mask = pad_rows([[1, 2, 3], [4]], 0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_rows([[1, 2, 3], [4]], -100, side="right")
    assert ids.tolist() == [[1, 2, 3], [4, -100, -100]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def _tiny_vlm(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    text.update(extra.pop("text", {}))
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, text_config=text, **extra)).eval()


def test_image_prompts_refused_where_positions_or_masks_differ(lvlm):
    """Qwen2-VL positions image tokens in 3-D (multimodal RoPE): with images, specdec's one
    position per token would give other logits than the model's own (measured on this tiny
    model: 0.018 at the last prompt token), so prompts with images are refused with the reason;
    text-only prompts decode as before. LLaVA has no such problem."""
    from specdec.models.support import image_prompt_problem

    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    qwen = _tiny_vlm("qwen2_vl", text={"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}, vision_config=vision, image_token_id=250)
    assert "multimodal RoPE" in (image_prompt_problem(qwen.config) or "")
    assert image_prompt_problem(lvlm["target"].config) is None
    ids = [5, 6, 251, *[250] * 4, 252, 7, 8]
    inputs = {"pixel_values": torch.randn(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    eng = SpeculativeEngine(qwen, make_policy("ar"), GreedyRule(), None, eos_token_ids=[2])
    with pytest.raises(SpecDecError, match=r"prompt 0 has 1 image\(s\), but the target \(qwen2_vl\) positions image tokens in three dimensions"):
        eng.generate([MultimodalPrompt(ids, inputs)], 4)
    with torch.no_grad():
        ref = qwen.generate(torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert eng.generate([[5, 6, 7, 8]], 6)[0].token_ids == ref  # text only: 1-D positions are the model's own


def test_bidirectional_image_attention_is_named():
    from transformers import AutoConfig

    from specdec.models.support import image_prompt_problem

    assert "both ways" in (image_prompt_problem(AutoConfig.for_model("gemma3")) or "")
    assert "both ways" in (image_prompt_problem(AutoConfig.for_model("paligemma")) or "")
    assert "both ways" in (image_prompt_problem(AutoConfig.for_model("gemma4", text_config={"use_bidirectional_attention": "vision"})) or "")
    assert image_prompt_problem(AutoConfig.for_model("gemma4")) is None  # the smaller Gemma 4 models keep image tokens causal
    assert "cross-attention" in (image_prompt_problem(AutoConfig.for_model("mllama")) or "")
    assert "three dimensions" in (image_prompt_problem(AutoConfig.for_model("qwen2_5_vl")) or "")  # found from the model class's get_rope_index
    assert image_prompt_problem(AutoConfig.for_model("llava")) is None
    assert image_prompt_problem(AutoConfig.for_model("llava_next")) is None


def test_llava_next_images_of_different_shapes_batch_exactly(lvlm):
    """LLaVA-NeXT splits each image into as many patches as its aspect ratio needs, so prompts'
    pixel values differ in shape ([images, patches, 3, H, W]); batched (all rows, and 2 rows with
    a prompt joining) they are zero-padded as its processor pads a batch, and greedy output equals
    the model's own generate() per prompt (before, any batch of two such prompts crashed)."""
    import numpy as np
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil, LlavaNextProcessor

    from specdec.training.lvlm import lvlm_config

    tok = lvlm["tok"]
    base = lvlm_config(SIZE_T, tok)
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    config = LlavaNextConfig(
        vision_config=base.vision_config, text_config=base.text_config, image_token_index=base.image_token_index, image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)

    def picture(seed: int, h: int, w: int) -> Image.Image:
        return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))

    prompts = [
        encode_multimodal(processor, TEXTS[0], [picture(0, 40, 80)]),  # 3 patches
        encode_multimodal(processor, TEXTS[0], [picture(1, 40, 40)]),  # 2 patches
        encode_multimodal(processor, TEXTS[1], [picture(2, 80, 40), picture(3, 30, 30)]),
    ]
    assert len({p.model_inputs["pixel_values"].shape[1:] for p in prompts}) == 2
    eos = tok.eos_token_id
    refs = [reference(model, p, 12, eos) for p in prompts]
    for method, batch_size in (("ar", 3), ("eagle2", 3), ("eagle2", 2)):
        eng = SpeculativeEngine(model, make_policy(method, **METHODS[method]), GreedyRule(), ModelDraftSource(model), eos_token_ids=[eos], pad_token_id=1)
        assert [o.token_ids for o in eng.generate(prompts, 12, batch_size=batch_size)] == refs, (method, batch_size)


def test_inputs_of_different_ranks_are_named():
    from specdec.multimodal.inputs import batch_model_inputs

    a = MultimodalPrompt([1, 2], {"pixel_values": torch.zeros(1, 3, 4, 4)})
    b = MultimodalPrompt([1, 2], {"pixel_values": torch.zeros(1, 2, 3, 4, 4)})
    with pytest.raises(SpecDecError, match=r"'pixel_values' inputs have different ranks \(\[4, 5\] dimensions\)"):
        batch_model_inputs([a, b])
    padded = batch_model_inputs([b, MultimodalPrompt([1], {"pixel_values": torch.ones(1, 3, 3, 4, 4)})])["pixel_values"]
    assert padded.shape == (2, 3, 3, 4, 4) and padded[0, 2].abs().sum() == 0 and padded[1].min() == 1  # zero-padded at the end


def tiny_gemma4():
    """A tiny Gemma 4 (its image tokens attend causally, as specdec's masks do), whose images are
    patch rows with (x, y) positions: an image of 4x4 patches becomes 4 image tokens, 4x6 six."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {
        "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "pooling_kernel_size": 2, "patch_size": 4, "position_embedding_size": 64,
    }
    config = AutoConfig.for_model("gemma4", text_config=text, vision_config=vision, image_token_id=300, boi_token_id=301, eoi_token_id=302, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(7.0)
    return model


def gemma4_image(h: int, w: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.rand(1, h * w, 48, generator=g), "image_position_ids": torch.tensor([[[x, y] for y in range(h) for x in range(w)]])}


def test_images_of_a_model_outside_the_batched_list_are_prefilled_a_prompt_at_a_time(monkeypatch):
    """Gemma 4 marks a batch's padded patches with position -1; concatenated and zero-padded
    alike (as LLaVA-NeXT's are), two images of 16 and 24 patches crashed its vision tower. Outside
    `BATCHED_IMAGE_MODEL_TYPES` each prompt with images is prefilled in a forward of its own (target
    and draft), so every batch size gives each prompt's own generate() tokens."""
    import specdec.multimodal.inputs as inputs_module

    model = tiny_gemma4()
    prompts = [
        MultimodalPrompt([5, 6, 7, 301, *[300] * 4, 302, 8, 9], gemma4_image(4, 4, 1)),
        MultimodalPrompt([11, 12, 301, *[300] * 6, 302, 15, 16, 17], gemma4_image(4, 6, 2)),
        [20, 21, 22, 23],
    ]
    refs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        extra = dict(prompt.model_inputs) if isinstance(prompt, MultimodalPrompt) else {}
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)
        refs.append(out[0, ids.shape[1] :].tolist())

    def decode(method: str, batch_size: int) -> list[list[int]]:
        options = {"depth": 3, "top_k": 2, "total_tokens": 6} if method == "eagle2" else {}
        source = ModelDraftSource(model) if method != "ar" else None
        engine = SpeculativeEngine(model, make_policy(method, **options), GreedyRule(), source, eos_token_ids=[2])
        return [o.token_ids for o in engine.generate(prompts, 10, batch_size=batch_size)]

    for method in ("ar", "eagle2"):
        for batch_size in (3, 2):
            assert decode(method, batch_size) == refs, (method, batch_size)
    monkeypatch.setattr(inputs_module, "BATCHED_IMAGE_MODEL_TYPES", inputs_module.BATCHED_IMAGE_MODEL_TYPES | {"gemma4"})
    try:  # the batched images, as before: transformers 5.24 raises inside the vision tower
        batched: list[list[int]] | None = decode("ar", 3)
    except RuntimeError:
        batched = None
    assert batched != refs


def test_vision_language_models_specdec_cannot_decode_are_named():
    """Found by the image sweep (benchmarks/architecture-sweep/images.md): they crashed or gave
    other tokens than their own generate(); now refused with the reason."""
    from transformers import AutoConfig

    from specdec.models.support import image_prompt_problem, tree_verification_problem

    assert "position ids" in (tree_verification_problem(AutoConfig.for_model("kosmos-2")) or "")
    assert "position ids" in (tree_verification_problem(AutoConfig.for_model("kosmos-2.5")) or "")
    assert "cross-attention" in (tree_verification_problem(AutoConfig.for_model("idefics")) or "")
    assert "before the prompt's tokens" in (image_prompt_problem(AutoConfig.for_model("git")) or "")
    assert tree_verification_problem(AutoConfig.for_model("git")) is None  # its text prompts decode exactly
    assert "both ways" in (image_prompt_problem(AutoConfig.for_model("molmo2")) or "")
    assert tree_verification_problem(AutoConfig.for_model("llava")) is None and image_prompt_problem(AutoConfig.for_model("llava")) is None
