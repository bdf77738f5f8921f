"""Train the bundled tiny LVLM pair (`specdec train lvlm`) on synthetic scenes.

One pass trains both models on the same batches: the target with cross-entropy on the
assistant's answer tokens, the draft with half cross-entropy and half distillation
(KL(target || draft) on the target's current, detached logits), so the draft tracks the
target as it learns. Data comes from `specdec.multimodal.scenes` (train split only), drawn
fresh every step, deterministic from the seed. The run stops after `steps` optimizer
steps; with `minutes` instead, the step count is set from the measured speed of the first
steps so the run fits the budget (so it depends on the machine; the log records it).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlavaForConditionalGeneration, PreTrainedTokenizerFast

from specdec.errors import SpecDecError
from specdec.multimodal.inputs import IMAGE_PLACEHOLDER
from specdec.multimodal.scenes import TASKS, Example, format_conversation, generate_examples, make_example
from specdec.padding import pad_rows
from specdec.training.lvlm import DRAFT_SIZE, EOS, TARGET_SIZE, LvlmSize, lvlm_config, make_processor, size_dict, train_lvlm_tokenizer

IGNORE = -100


@dataclass
class LvlmTrainConfig:
    steps: int | None = None
    """optimizer steps (None: set from `minutes`)"""
    minutes: float = 45.0
    """wall-time budget used when `steps` is None"""
    batch_size: int = 16
    lr: float = 1e-3
    draft_lr: float = 2e-3
    vision_lr_scale: float = 0.0
    """the vision tower's and projector's learning rate relative to the language model's.
    0 (default) keeps them frozen at their random initialisation: trained from scratch
    together with the language model (scales 1.0, 0.5, 0.2 tried), they collapsed to
    near-constant features within a few hundred steps and the model ignored the image;
    frozen random features keep each patch's content (a random projection) and the
    language model learns to read them"""
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    distill_weight: float = 0.5
    """the draft's loss: (1 - w) * CE + w * KL(target || draft)"""
    vocab_size: int = 1024
    seed: int = 0
    threads: int = 0
    """torch threads (0: leave torch's default)"""


def encode_example(example: Example, tokenizer: PreTrainedTokenizerFast, image_tokens: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of a whole conversation: labels are the answer tokens (EOS
    included), -100 elsewhere. Each `<image>` is expanded to `image_tokens` image tokens,
    as the processor does at inference. Segments are tokenised separately; the prompt of
    answer k ("... ASSISTANT:") tokenises the same way, since answers start with a space."""
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    ids: list[int] = []
    labels: list[int] = []
    for user, answer in example.turns:
        prompt = tokenizer(f"USER: {user} ASSISTANT:")["input_ids"]
        expanded = [t for tok in prompt for t in ([tok] * image_tokens if tok == image_id else [tok])]
        reply = tokenizer(f" {answer}{EOS}")["input_ids"]
        ids += expanded + reply
        labels += [IGNORE] * len(expanded) + reply
    return ids, labels


def _batch(examples: list[Example], tokenizer, processor, image_tokens: int) -> dict[str, torch.Tensor]:
    encoded = [encode_example(ex, tokenizer, image_tokens) for ex in examples]
    input_ids, mask = pad_rows([ids for ids, _ in encoded], tokenizer.pad_token_id, side="right")
    labels, _ = pad_rows([lab for _, lab in encoded], IGNORE, side="right")
    images = [img for ex in examples for img in ex.images()]
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if images:
        batch["pixel_values"] = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    return batch


def _lr(step: int, total: int, cfg: LvlmTrainConfig, peak: float) -> float:
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _is_vision(name: str) -> bool:
    return "vision_tower" in name or "multi_modal_projector" in name


def _optimizer(model: torch.nn.Module, lr: float, weight_decay: float, vision_scale: float) -> torch.optim.AdamW:
    """Four groups: (language | vision) x (decayed matrices | the rest); each group's "scale"
    multiplies the scheduled learning rate."""
    groups = []
    if vision_scale == 0:  # a frozen (random) vision tower and projector
        for n, p in model.named_parameters():
            if _is_vision(n):
                p.requires_grad_(False)
    for vision in (False, True):
        params = [(n, p) for n, p in model.named_parameters() if _is_vision(n) == vision and p.requires_grad]
        scale = vision_scale if vision else 1.0
        decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
        rest = [p for n, p in params if p.ndim < 2 or "embed" in n]
        groups += [{"params": decay, "weight_decay": weight_decay, "scale": scale}, {"params": rest, "weight_decay": 0.0, "scale": scale}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def _forward(model, batch) -> torch.Tensor:
    """Logits [B, L-1, V] predicting tokens 1..L-1."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**kwargs).logits[:, :-1]


def train_lvlm(out_dir: Path, cfg: LvlmTrainConfig, target_size: LvlmSize = TARGET_SIZE, draft_size: LvlmSize = DRAFT_SIZE, log=print) -> dict[str, Any]:
    """Train tokenizer, target and draft; save them (float16) with processor files in out_dir/{target,draft}."""
    if target_size.image_tokens != draft_size.image_tokens or target_size.image_size != draft_size.image_size:
        raise SpecDecError("target and draft must read images the same way (same image size and patch grid)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    corpus = [format_conversation(ex.turns) for ex in generate_examples(4000, cfg.seed + 17, "train")]
    tokenizer = train_lvlm_tokenizer(corpus, out_dir / "tokenizer", vocab_size=cfg.vocab_size)
    torch.manual_seed(cfg.seed)
    target = LlavaForConditionalGeneration(lvlm_config(target_size, tokenizer)).train()
    draft = LlavaForConditionalGeneration(lvlm_config(draft_size, tokenizer)).train()
    processor = make_processor(tokenizer, target_size)
    opt_t = _optimizer(target, cfg.lr, cfg.weight_decay, cfg.vision_lr_scale)
    opt_d = _optimizer(draft, cfg.draft_lr, cfg.weight_decay, cfg.vision_lr_scale)
    rng = random.Random(cfg.seed)
    total = cfg.steps
    calibrate_at = 20
    log_every = 25
    history: list[dict[str, float]] = []
    t_loop = time.perf_counter()
    step = 0
    while total is None or step < total:
        examples = [make_example(rng, "train") for _ in range(cfg.batch_size)]
        batch = _batch(examples, tokenizer, processor, target_size.image_tokens)
        labels = batch["labels"][:, 1:]
        answer = labels != IGNORE  # [B, L-1]
        planned = total if total is not None else 10**9
        for opt, peak in ((opt_t, cfg.lr), (opt_d, cfg.draft_lr)):
            for group in opt.param_groups:
                group["lr"] = _lr(step, planned, cfg, peak) * group["scale"]
        # target: cross-entropy on answer tokens
        t_logits = _forward(target, batch)
        loss_t = F.cross_entropy(t_logits[answer], labels[answer])
        opt_t.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), cfg.grad_clip)
        opt_t.step()
        # draft: CE + KL to the target's (detached) distribution
        d_logits = _forward(draft, batch)[answer]
        ce_d = F.cross_entropy(d_logits, labels[answer])
        t_logp = F.log_softmax(t_logits.detach()[answer], dim=-1)
        kl_d = F.kl_div(F.log_softmax(d_logits, dim=-1), t_logp, log_target=True, reduction="batchmean")
        loss_d = (1 - cfg.distill_weight) * ce_d + cfg.distill_weight * kl_d
        opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt_d.step()
        step += 1
        if total is None and step == calibrate_at:
            per_step = (time.perf_counter() - t_loop) / calibrate_at
            total = max(calibrate_at + 1, int(cfg.minutes * 60 / per_step))
            log(f"{per_step:.2f} s/step -> {total} steps for a {cfg.minutes:g}-minute budget")
        if step % log_every == 0 or step == total:
            entry = {"step": step, "target_ce": loss_t.item(), "draft_ce": ce_d.item(), "draft_kl": kl_d.item(), "elapsed_s": time.perf_counter() - t_start}
            history.append(entry)
            log(f"step {step}/{total}  target CE {entry['target_ce']:.3f}  draft CE {entry['draft_ce']:.3f}  KL {entry['draft_kl']:.3f}  {entry['elapsed_s'] / 60:.1f} min")
    train_s = time.perf_counter() - t_start
    for name, model, size in (("target", target, target_size), ("draft", draft, draft_size)):
        model.eval()
        folder = out_dir / name
        model.to(torch.float16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        make_processor(tokenizer, size).save_pretrained(folder)
        model.to(torch.float32)
    record = {
        "config": asdict(cfg),
        "steps": step,
        "train_s": train_s,
        "examples_seen": step * cfg.batch_size,
        "target_size": size_dict(target_size),
        "draft_size": size_dict(draft_size),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "tasks": list(TASKS),
        "history": history,
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "train_log.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved target and draft to {out_dir} ({train_s / 60:.1f} min)")
    return record


LVLM_BUNDLE_FILES = ("target", "draft", "train_log.json")


def bundle_lvlm(source: Path, dest: Path | None = None) -> Path:
    """Copy a trained LVLM pair into the package's assets (the default vision-language pair)."""
    from specdec.models.loading import BUNDLED_LVLM
    from specdec.training.pair import copy_bundle

    return copy_bundle(source, dest or BUNDLED_LVLM, LVLM_BUNDLE_FILES, "specdec train lvlm")
