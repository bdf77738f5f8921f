"""Per-type tiny configs and image inputs for the sweep."""

from __future__ import annotations

import contextlib

import torch

VOCAB = 384
IMG = 300
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
          "projection_dim": 32}


class Spec:
    def __init__(self, mtype):
        self.mtype = mtype
        self.text = dict(TEXT)
        self.vision = dict(VISION)
        self.top = {"image_token_id": IMG, "tie_word_embeddings": False}
        self.model_fn = None
        self.head_scale = 7.0
        self.n_image_tokens = None
        self.prefix = []
        self.suffix = []
        self.text_prefix = []
        self.eos = 2
        self.pad = 0
        self.img = IMG
        self.image_size = 32
        self.setup()

    def setup(self):
        pass

    @property
    def config_kwargs(self):
        return {"text_config": self.text, "vision_config": self.vision, **self.top}

    def post_config(self, cfg):
        for attr in ("image_token_id", "image_token_index"):
            if attr in type(cfg).__dict__ or hasattr(cfg, attr):
                with contextlib.suppress(Exception):
                    setattr(cfg, attr, self.img)
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
        tc = cfg.get_text_config()
        if hasattr(tc, "tie_word_embeddings"):
            tc.tie_word_embeddings = False

    def post_build(self, model):
        # some vision towers (SAM: initializer_range 1e-10) init to ~0, so images would not matter: re-init those weights
        with torch.no_grad():
            for mod in model.modules():
                w = getattr(mod, "weight", None)
                if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)) and w is not None and w.numel() > 1 and w.std().item() < 1e-6:
                    w.normal_(0.0, 0.02)

    def prompt_extra(self, ids):
        """token-aligned inputs a real processor returns and specdec's encode_multimodal keeps"""
        return {}

    def ref_extra(self, ids, has_image):
        """per-token inputs a real processor gives generate() but specdec's encode_multimodal drops"""
        return {}

    def wrap(self, text, n):
        return list(text) + self.prefix + [self.img] * n + self.suffix

    def image_inputs(self, model, seed):
        s = self.image_size
        return {"pixel_values": torch.randn(1, 3, s, s)}


def default_spec(mtype):
    return Spec(mtype)


SPECS: dict[str, type] = {}


def spec(name):
    def deco(cls):
        SPECS[name] = cls
        return cls
    return deco


@spec("llava_onevision")
class OneVision(Spec):
    def setup(self):
        self.top.update(image_grid_pinpoints=[[32, 32], [32, 64], [64, 32]], vision_feature_layer=-1)

    def image_inputs(self, model, seed):
        if seed == 1:
            return {"pixel_values": torch.randn(1, 2, 3, 32, 32), "image_sizes": torch.tensor([[32, 32]])}
        return {"pixel_values": torch.randn(1, 3, 3, 32, 32), "image_sizes": torch.tensor([[32, 64]])}


@spec("vipllava")
class VipLlava(Spec):
    def setup(self):
        self.top.update(vision_feature_layer=-1)


@spec("mistral3")
class Mistral3(Spec):
    def setup(self):
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 64, "patch_size": 8, "head_dim": 16}

    def image_inputs(self, model, seed):
        if seed == 1:
            return {"pixel_values": torch.randn(1, 3, 32, 32), "image_sizes": torch.tensor([[32, 32]])}
        return {"pixel_values": torch.randn(1, 3, 32, 48), "image_sizes": torch.tensor([[32, 48]])}


class FiveD(Spec):
    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 1, 3, 32, 32)}


@spec("idefics3")
class Idefics3(FiveD):
    pass


@spec("smolvlm")
class SmolVLM(FiveD):
    pass


@spec("idefics2")
class Idefics2(FiveD):
    def setup(self):
        self.top.update(perceiver_config={"resampler_n_latents": 8, "resampler_depth": 1, "resampler_n_heads": 2, "resampler_head_dim": 16, "num_key_value_heads": 2, "hidden_size": 64})


@spec("paligemma")
class PaliGemma(Spec):
    def setup(self):
        self.top.update(projection_dim=64, hidden_size=64)


@spec("gemma3")
class Gemma3(Spec):
    def setup(self):
        self.top.update(mm_tokens_per_image=4, boi_token_index=301, eoi_token_index=302)
        self.prefix, self.suffix = [301], [302]


@spec("lfm2_vl")
class Lfm2Vl(Spec):
    def setup(self):
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 8, "num_patches": 64}
        self.top.update(projector_hidden_size=64)
        self.text = dict(TEXT)
        self.text.pop("head_dim")

    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        return {"pixel_values": torch.randn(1, h * w, 192), "spatial_shapes": torch.tensor([[h, w]]),
                "pixel_attention_mask": torch.ones(1, h * w, dtype=torch.long)}


def _flat_text():
    t = dict(TEXT)
    return t


@spec("chameleon")
class Chameleon(Spec):
    def setup(self):
        letters = "ABCDEFGHIJ"
        vmap = {"<image>": IMG}
        for i in range(16):
            vmap["IMGIMG" + "".join(letters[int(c)] for c in str(i)) + "Z"] = 320 + i
        self.vmap = vmap
        self.flat = dict(TEXT, vq_config={"embed_dim": 16, "num_embeddings": 16, "latent_channels": 16, "resolution": 32, "base_channels": 32,
                                          "channel_multiplier": [1, 1, 1], "num_res_blocks": 1, "attn_resolutions": []},
                         vocabulary_map=vmap)
        self.flat.pop("head_dim")

    @property
    def config_kwargs(self):
        return self.flat


@spec("emu3")
class Emu3(Spec):
    def setup(self):
        vmap = {"<image>": IMG, "<|extra_200|>": 303}
        for i in range(16):
            vmap[f"<|visual token {i:06d}|>"] = 320 + i
        self.text = dict(TEXT)
        self.text.pop("head_dim")
        self.vq = {"codebook_size": 16, "embed_dim": 4, "latent_channels": 4, "base_channels": 32, "channel_multiplier": [1, 1, 1],
                   "num_res_blocks": 1, "attn_resolutions": [], "hidden_size": 32, "num_attention_heads": 1, "temporal_downsample_factor": 4}
        self.vmap = vmap

    @property
    def config_kwargs(self):
        return {"text_config": self.text, "vq_config": self.vq, "vocabulary_map": self.vmap}

    def image_inputs(self, model, seed):
        if seed == 1:
            return {"pixel_values": torch.randn(1, 3, 32, 32), "image_sizes": torch.tensor([[32, 32]])}
        return {"pixel_values": torch.randn(1, 3, 32, 48), "image_sizes": torch.tensor([[32, 48]])}


class QwenLike(Spec):
    start_attr, end_attr = "vision_start_token_id", "vision_end_token_id"
    def setup(self):
        self.text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
        self.vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "out_hidden_size": 64}
        self.top.update({self.start_attr: 301, self.end_attr: 302})
        self.prefix, self.suffix = [301], [302]

    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        return {"pixel_values": torch.randn(h * w, 3 * 2 * 4 * 4), "image_grid_thw": torch.tensor([[1, h, w]])}

    def prompt_extra(self, ids):
        """token-aligned inputs a real processor returns and specdec's encode_multimodal keeps"""
        return {}

    def ref_extra(self, ids, has_image):
        return {"mm_token_type_ids": torch.tensor([[1 if t == IMG else 0 for t in ids]])}


@spec("qwen2_5_vl")
class Qwen25VL(QwenLike):
    def setup(self):
        super().setup()
        self.vision.update(fullatt_block_indexes=[0], window_size=16)


@spec("glm4v")
class Glm4v(QwenLike):
    start_attr, end_attr = "image_start_token_id", "image_end_token_id"
    def setup(self):
        super().setup()
        self.vision.update(image_size=16)
        self.text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


@spec("blip-2")
class Blip2(Spec):
    def setup(self):
        self.text = dict(TEXT, model_type="llama")
        self.top.update(num_query_tokens=4, image_token_index=IMG,
                        qformer_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64, "encoder_hidden_size": 32, "vocab_size": 64})
        self.n_image_tokens = 4

    @property
    def config_kwargs(self):
        return {"text_config": self.text, "vision_config": self.vision, "qformer_config": self.top["qformer_config"],
                "num_query_tokens": 4, "image_token_index": IMG}


@spec("instructblip")
class InstructBlip(Blip2):
    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 3, 32, 32), "qformer_input_ids": torch.tensor([[5, 6, 7, 8][: 2 + seed]]),
                "qformer_attention_mask": torch.ones(1, 2 + seed, dtype=torch.long)}


@spec("kosmos-2")
class Kosmos2(Spec):
    def setup(self):
        self.text = {"vocab_size": VOCAB, "embed_dim": 64, "layers": 2, "ffn_dim": 128, "attention_heads": 4, "max_position_embeddings": 512,
                     "tie_word_embeddings": False, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
        self.top = {"latent_query_num": 4, "tie_word_embeddings": False}
        self.n_image_tokens = 4
        self.prefix, self.suffix = [301], [302]
        self.pad = 1

    def prompt_extra(self, ids):
        return {"image_embeds_position_mask": torch.tensor([[1 if t == IMG else 0 for t in ids]])}


@spec("ovis2")
class Ovis2(Spec):
    def setup(self):
        self.vision = dict(VISION, vocab_size=64)
        self.vision.pop("projection_dim")
        self.top.update(vocab_size=VOCAB, hidden_size=64, visual_indicator_token_ids=[310, 311, 312, 313, 314])
        self.prefix, self.suffix = [310], [311]


@spec("llama4")
class Llama4(Spec):
    def setup(self):
        self.vision = dict(VISION, intermediate_size=128, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
        self.vision.pop("projection_dim")
        self.text = dict(TEXT, intermediate_size_mlp=128, num_local_experts=2)
        self.top.update(boi_token_index=301, eoi_token_index=302, image_token_index=IMG)
        self.prefix, self.suffix = [301], [302]


@spec("mllama")
class Mllama(Spec):
    def setup(self):
        self.vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 2, "intermediate_size": 64,
                       "vision_output_dim": 64, "image_size": 32, "patch_size": 8, "max_num_tiles": 1, "intermediate_layers_indices": [0],
                       "supported_aspect_ratios": [[1, 1]]}
        self.text = dict(TEXT, cross_attention_layers=[1])
        self.top = {"image_token_index": IMG, "tie_word_embeddings": False}
        self.n_image_tokens = 1

    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 1, 1, 3, 32, 32), "aspect_ratio_ids": torch.tensor([[1]]),
                "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long)}

    def prompt_extra(self, ids):
        first = ids.index(IMG)
        m = torch.zeros(1, len(ids), 1, 1, dtype=torch.long)
        m[:, first:] = 1
        return {"cross_attention_mask": m}


@spec("florence2")
class Florence2(Spec):
    def setup(self):
        self.vision = {"depths": [1, 1], "patch_size": [7, 3], "patch_stride": [4, 2], "patch_padding": [3, 1], "patch_prenorm": [False, True],
                       "embed_dim": [32, 64], "num_heads": [2, 4], "num_groups": [2, 4], "window_size": 4, "projection_dim": 64}
        self.text = {"vocab_size": VOCAB, "d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
                     "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_position_embeddings": 512,
                     "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "decoder_start_token_id": 2, "tie_word_embeddings": False}
        self.pad = 1


for _name in ("glm46v", "glm4v_moe", "glm_ocr", "glmga"):
    SPECS[_name] = Glm4v
for _name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
    SPECS[_name] = QwenLike


class Qwen3Like(QwenLike):
    def setup(self):
        super().setup()
        self.vision.update(deepstack_visual_indexes=[0], num_position_embeddings=64)
        self.text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, "mrope_interleaved": True}


for _name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
    SPECS[_name] = Qwen3Like


@spec("instructblipvideo")
class InstructBlipVideo(InstructBlip):
    def image_inputs(self, model, seed):
        d = super().image_inputs(model, seed)
        d["pixel_values"] = d["pixel_values"][:, None]
        return d


for _name in ("lighton_ocr", "mistral_large4"):
    SPECS[_name] = Mistral3
SPECS["llava_next_video"] = OneVision
SPECS['shieldgemma2'] = Gemma3


@spec("gemma4")
class Gemma4(Spec):
    def setup(self):
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                       "head_dim": 16, "pooling_kernel_size": 2, "patch_size": 4, "position_embedding_size": 64}
        self.top = {"image_token_id": IMG, "boi_token_id": 301, "eoi_token_id": 302, "tie_word_embeddings": False}
        self.prefix, self.suffix = [301], [302]

    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        pos = torch.tensor([[[x, y] for y in range(h) for x in range(w)]])
        return {"pixel_values": torch.rand(1, h * w, 48), "image_position_ids": pos}
SPECS["paddleocr_vl"] = QwenLike


class Qwen35(Qwen3Like):
    def setup(self):
        super().setup()
        self.text["layer_types"] = ["linear_attention", "full_attention"]


for _name in ("qwen3_5", "qwen3_5_moe"):
    SPECS[_name] = Qwen35


@spec("lfm2_vl_conv")
class Lfm2VlConv(Lfm2Vl):
    """lfm2_vl with one short-conv layer (real LFM2 checkpoints mix conv and attention)"""
    def setup(self):
        super().setup()
        self.mtype = "lfm2_vl"
        self.text["layer_types"] = ["conv", "full_attention"]


@spec("git")
class Git(Spec):
    """GIT prepends the image embeddings itself: no placeholder tokens in input_ids"""
    def setup(self):
        self.flat = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                     "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
                     "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}}
        self.n_image_tokens = 0

    @property
    def config_kwargs(self):
        return self.flat


@spec("idefics")
class Idefics(Spec):
    """IDEFICS v1: gated cross-attention to images; one <image> token per image, image_attention_mask [B, L, n_images]"""
    def setup(self):
        self.flat = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "max_position_embeddings": 512, "tie_word_embeddings": False, "cross_layer_interval": 1,
                     "vision_config": {"embed_dim": 32, "image_size": 32, "intermediate_size": 64, "patch_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}}
        self.n_image_tokens = 1

    @property
    def config_kwargs(self):
        return self.flat

    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 1, 3, 32, 32)}

    def prompt_extra(self, ids):
        first = ids.index(IMG)
        m = torch.zeros(1, len(ids), 1, dtype=torch.long)
        m[:, first:] = 1
        return {"image_attention_mask": m}


@spec("fuyu")
class Fuyu(Spec):
    def setup(self):
        self.text = dict(TEXT, model_type="persimmon")
        self.text.pop("head_dim")
        self.text.pop("num_key_value_heads")
        self.top = {"image_token_id": IMG, "patch_size": 8, "image_size": 32, "hidden_size": 64, "vocab_size": VOCAB, "tie_word_embeddings": False}

    @property
    def config_kwargs(self):
        return {"text_config": self.text, **self.top}

    def image_inputs(self, model, seed):
        n = 16 if seed == 1 else 24
        return {"pixel_values": torch.randn(1, n, 192)}


SPECS["granite4_vision"] = OneVision


@spec("deepseek_vl_hybrid")
class DeepseekVLHybrid(Spec):
    def setup(self):
        self.top.update(high_res_vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64, "patch_size": 8,
                                                "output_channels": 16, "global_attn_indexes": [1], "mlp_dim": 64, "window_size": 4})

    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 3, 32, 32), "high_res_pixel_values": torch.randn(1, 3, 64, 64)}


@spec("aria")
class Aria(Spec):
    def setup(self):
        self.vision.pop("projection_dim")
        self.text = dict(TEXT, moe_num_experts=2, moe_topk=1, moe_num_shared_experts=1, pad_token_id=0)
        self.top.update(projector_patch_to_query_dict={16: 4}, image_token_index=IMG)
        self.top.pop("image_token_id")

    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 3, 32, 32), "pixel_mask": torch.ones(1, 32, 32, dtype=torch.bool)}


class Grid1D(Spec):
    """grid_thw vision towers (Qwen-style patches) on a text model with 1-D positions"""
    tps = 2
    def setup(self):
        self.vision = {"depth": 1, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_attention_heads": 2,
                       "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": self.tps, "out_hidden_size": 64,
                       "fullatt_block_indexes": [0], "window_size": 16}

    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        return {"pixel_values": torch.randn(h * w, 3 * self.tps * 4 * 4), "image_grid_thw": torch.tensor([[1, h, w]])}


@spec("hyperclovax_vision_v2")
class HyperClovaX(Grid1D):
    pass


@spec("video_llama_3")
class VideoLlama3(Grid1D):
    tps = 1
    def setup(self):
        super().setup()
        for k in ("depth", "num_heads", "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "fullatt_block_indexes", "window_size"):
            self.vision.pop(k)

    def image_inputs(self, model, seed):
        d = super().image_inputs(model, seed)
        d["image_merge_sizes"] = torch.tensor([2])
        return d


@spec("kimi_k25")
class KimiK25(Spec):
    def setup(self):
        self.vision = {"patch_size": 4, "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                       "merge_kernel_size": [2, 2], "pos_emb_height": 8, "pos_emb_width": 8}
        self.text = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
        self.top.update(projection_hidden_size=32)

    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        return {"pixel_values": torch.randn(h * w, 3, 4, 4), "image_grid_thw": torch.tensor([[1, h, w]])}


@spec("lfm3_vl")
class Lfm3Vl(Grid1D):
    def setup(self):
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
        self.text = dict(TEXT)
        self.text["layer_types"] = ["conv", "full_attention"]
        self.top.update(projector_hidden_size=64, vision_start_token_id=301, vision_end_token_id=302)
        self.prefix, self.suffix = [301], [302]


for _name in ("cosmos3_omni", "qwen4_exp", "qwen3_omni_moe_thinker"):
    SPECS[_name] = Qwen3Like
SPECS["qwen2_5_omni_thinker"] = Qwen25VL


class NoMMType:
    def ref_extra(self, ids, has_image):
        return {}


SPECS["qwen3_omni_moe_thinker"] = type("Q3Omni", (NoMMType, Qwen3Like), {})
SPECS["qwen2_5_omni_thinker"] = type("Q25Omni", (NoMMType, Qwen25VL), {})
SPECS["qwen4_exp"] = Qwen35


@spec("paddleocr_vl")
class PaddleOCRVL(QwenLike):
    def setup(self):
        super().setup()
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "image_size": 32}

    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        return {"pixel_values": torch.randn(1, h * w, 3, 4, 4), "image_grid_thw": torch.tensor([[1, h, w]])}


MLA_TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "qk_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "index_head_dim": 16, "index_n_heads": 2}


@spec("mistral_large4")
class MistralLarge4(Mistral3):
    def setup(self):
        super().setup()
        self.text = dict(MLA_TEXT)
SPECS["gemma4_unified"] = Gemma4


@spec("gemma4_unified")
class Gemma4Unified(Gemma4):
    def image_inputs(self, model, seed):
        h, w = (2, 2) if seed == 1 else (2, 3)
        pos = torch.tensor([[[x, y] for y in range(h) for x in range(w)]])
        return {"pixel_values": torch.rand(1, h * w, 192), "image_position_ids": pos}


def variant(name, base=Spec, text=None, vision=None, top=None, drop_text=(), drop_vision=()):
    def setup(self):
        base.setup(self)
        self.text.update(text or {})
        self.vision.update(vision or {})
        self.top.update(top or {})
        for k in drop_text:
            self.text.pop(k, None)
        for k in drop_vision:
            self.vision.pop(k, None)
    SPECS[name] = type(name, (base,), {"setup": setup})


variant("dots3_note", text={"num_key_value_heads": 4})
variant("glm5_next", text={"num_key_value_heads": 4})
variant("granite_docling", vision={"out_hidden_size": 64})
variant("inkling2", vision={"text_hidden_size": 64})
variant("inkling2_loop", vision={"text_hidden_size": 64})
variant("cosmos3_edge", base=Qwen3Like)


@spec("granite_docling")
class GraniteDocling(Spec):
    def setup(self):
        self.vision.update(out_hidden_size=64)

    def image_inputs(self, model, seed):
        t = 1 if seed == 1 else 2
        return {"pixel_values": torch.randn(1, t, 3, 32, 32), "pixel_attention_mask": torch.ones(1, t, dtype=torch.bool)}

variant("inkling2", base=Grid1D, vision={"text_hidden_size": 64})
variant("inkling2_loop", base=Grid1D, vision={"text_hidden_size": 64})
variant("glm5_next", base=Grid1D, text={"num_key_value_heads": 4})
variant("glm5_next", base=Grid1D, text={"num_key_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]})

variant("exaone4_5", base=Grid1D, text={"model_type": "exaone4"})
_rp = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
variant("cohere_compass", base=QwenLike, text={"rope_parameters": {"full_attention": _rp, "sliding_attention": _rp}})
variant("exaone4_5", base=Grid1D, text={"model_type": "exaone4"}, vision={"num_key_value_heads": 2})
variant("minimax_m3_vl", base=Grid1D)
variant("muse_glimmer", base=Grid1D)
variant("step3p7", text={"sliding_window": 8})


class _Minimax(Grid1D):
    def setup(self):
        super().setup()
        self.eos = 383  # with eos=2 prompt 0's reference stopped after 1 token


SPECS["minimax_m3_vl"] = _Minimax


class _Hunyuan(QwenLike):
    def image_inputs(self, model, seed):
        h, w = (4, 4) if seed == 1 else (4, 6)
        return {"pixel_values": torch.randn(h * w, 3 * 4 * 4), "image_grid_thw": torch.tensor([[1, h, w]])}


class _HunyuanV(_Hunyuan):
    def setup(self):
        super().setup()
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "out_hidden_size": 64, "max_image_size": 64}


SPECS["hunyuan_vl"] = _HunyuanV
SPECS["hy_v4_vl"] = _HunyuanV


@spec("deepseek_ocr2")
class DeepseekOcr2(Spec):
    def setup(self):
        self.vision = {"sam_config": {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64,
                                      "patch_size": 8, "window_size": 4, "global_attn_indexes": [1], "mlp_dim": 64, "downsample_channels": [32, 64]},
                       "encoder_config": {"vocab_size": 16, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                                          "num_key_value_heads": 4, "max_position_embeddings": 512}}

    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 3, 64, 64)}
variant("deepseek_ocr2", base=DeepseekOcr2, text={"mlp_layer_types": ["dense", "dense"]})


@spec("molmo2")
class Molmo2(Spec):
    """one 16x16 crop (4x4 patches of 4px), pooled 2x2 -> 4 image tokens; the processor also returns
    mm_token_type_ids (image tokens attend both ways), which specdec's encode_multimodal drops"""
    with_type_ids = True

    def setup(self):
        self.vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                       "head_dim": 16, "image_size": [16, 16], "patch_size": 4, "num_position_embeddings": 16}
        self.adapter = {"vision_feature_layer": [-1], "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                        "intermediate_size": 128, "text_hidden_size": 64}
        self.text = dict(TEXT, additional_vocab_size=0)
        self.top = {"image_patch_id": IMG, "image_start_token_id": 301, "image_end_token_id": 302, "low_res_image_start_token_id": 303,
                    "tie_word_embeddings": False}
        self.prefix, self.suffix = [301], [302]
        self.n_image_tokens = 4

    @property
    def config_kwargs(self):
        return {"text_config": self.text, "vision_config": self.vision, "adapter_config": self.adapter, **self.top}

    def image_inputs(self, model, seed):
        pool = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]])
        return {"pixel_values": torch.randn(1, 16, 48), "image_token_pooling": pool, "image_grids": torch.tensor([[2, 2, 0, 0]]),
                "image_num_crops": torch.tensor([1])}

    def ref_extra(self, ids, has_image):
        if not self.with_type_ids:
            return {}
        return {"mm_token_type_ids": torch.tensor([[1 if t == IMG else 0 for t in ids]])}


class Molmo2NoTypeIds(Molmo2):
    with_type_ids = False

    def setup(self):
        super().setup()
        self.mtype = "molmo2"


SPECS["molmo2_no_type_ids"] = Molmo2NoTypeIds


def _molmo_post_build(self, model):
    # random init makes the image's residual contribution ~1e-6: scale the projector so images matter
    with torch.no_grad():
        for p in model.model.multi_modal_projector.image_projector.parameters():
            p.mul_(200.0)


Molmo2.post_build = _molmo_post_build


def _idefics2_post_build(self, model):
    Spec.post_build(self, model)
    with torch.no_grad():  # the perceiver's latents swamp the image at random init: scale the image side up
        for p in model.model.connector.modality_projection.parameters():
            p.mul_(20.0)


Idefics2.post_build = _idefics2_post_build


def _idefics2_post_build2(self, model):
    Spec.post_build(self, model)
    with torch.no_grad():  # random init: latents swamp the image in the perceiver; shrink them, sharpen attention
        pr = model.model.connector.perceiver_resampler
        for n, p in pr.named_parameters():
            if "q_proj" in n or "k_proj" in n:
                p.mul_(30.0)
        pr.latents.mul_(0.01)


Idefics2.post_build = _idefics2_post_build2


@spec("kosmos-2.5")
class Kosmos25(Kosmos2):
    def setup(self):
        super().setup()
        self.vision = {"hidden_size": 32, "patch_embed_hidden_size": 48, "intermediate_size": 64, "head_dim": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "max_num_patches": 64}

    def image_inputs(self, model, seed):
        rows = torch.arange(1, 5).repeat_interleave(4).float()
        cols = torch.arange(1, 5).repeat(4).float()
        fp = torch.cat([rows[:, None], cols[:, None], torch.randn(16, 48)], dim=1)[None]
        return {"flattened_patches": fp}


class _MuseGlimmer(Grid1D):
    def setup(self):
        self.vision = {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32,
                       "intermediate_size": 64, "patch_temporal": 2, "merge_size": 2, "layer_types": ["full_attention"]}
        self.top.update(out_hidden_size=128, projector_hidden_size=64)
        self.text["layer_types"] = ["sliding_attention", "full_attention"]
        self.text["sliding_window"] = 8


SPECS["muse_glimmer"] = _MuseGlimmer


class _Inkling(Spec):
    def setup(self):
        self.vision = {"text_hidden_size": 64, "patch_size": 8, "temporal_patch_size": 2, "hidden_size": 32, "n_layers": 1, "num_attention_heads": 2}
        self.top.update(image_bos_token_id=301)
        self.prefix = [301]

    def image_inputs(self, model, seed):
        return {"pixel_values": torch.randn(1, 2, 32, 32, 3)}


SPECS["inkling_mm_model"] = _Inkling
variant("inkling_mm_model", base=_Inkling)
SPECS["inkling_mm_model"].n_image_tokens = 16


class _Inkling16(_Inkling):
    def setup(self):
        super().setup()
        self.n_image_tokens = 16


SPECS["inkling_mm_model"] = _Inkling16
