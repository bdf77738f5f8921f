"""Train the bundled GPT-NeoX target/draft pair on a code corpus.

`train_pair` runs: tokenizer (unless one is given) -> tokenise corpus -> train target ->
train draft (optionally distilled from the target's logits) -> save both in float16
safetensors with the tokenizer beside each, plus the `stdlib-heldout` prompt set.
Every stage checkpoints periodically and resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, PreTrainedModel

from specdec.training.corpus import build_prompt_set, iter_texts, list_sources, split_sources
from specdec.training.tokenizer import train_tokenizer


@dataclass
class ModelShape:
    """GPT-NeoX shape. Embeddings are tied to keep the shipped weights small."""

    hidden_size: int
    num_layers: int
    num_heads: int
    """head dim = hidden_size / num_heads; 64 for both bundled models"""
    intermediate_size: int
    max_position_embeddings: int = 2048

    def config(self, vocab_size: int, eos_token_id: int, pad_token_id: int) -> GPTNeoXConfig:
        return GPTNeoXConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            use_parallel_residual=True,
            rotary_pct=0.25,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )


TARGET_SHAPE = ModelShape(hidden_size=448, num_layers=10, num_heads=7, intermediate_size=1792)
"""~28M parameters: deep enough that one decoding step costs >= 8x the draft's on a CPU."""
DRAFT_SHAPE = ModelShape(hidden_size=256, num_layers=1, num_heads=4, intermediate_size=1024)
"""~2.9M parameters (2.1M of them the tied embedding): one layer keeps a step cheap."""


@dataclass
class StageConfig:
    """One training run (target or draft)."""

    steps: int
    """optimizer steps; the schedule is defined over this many"""
    batch_size: int = 8
    """sequences per step"""
    seq_len: int = 512
    """tokens per sequence (random windows of the token stream)"""
    lr: float = 1e-3
    """peak learning rate of the cosine schedule"""
    warmup_steps: int = 50
    """linear warm-up steps"""
    min_lr_ratio: float = 0.1
    """the schedule decays to lr * min_lr_ratio"""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    """steps between checkpoints (resume restarts from the last one)"""
    distill_weight: float = 0.0
    """draft only: weight of KL(target || draft) in the loss; 0 = plain next-token loss"""


@dataclass
class PairConfig:
    """Everything `train_pair` needs; saved next to the outputs for reproducibility."""

    out_dir: str
    corpus: list[str] = field(default_factory=list)
    """folders or files; empty = the running interpreter's standard library"""
    vocab_size: int = 8192
    seed: int = 0
    target: StageConfig = field(default_factory=lambda: StageConfig(steps=1000, batch_size=4, lr=1e-3))
    draft: StageConfig = field(default_factory=lambda: StageConfig(steps=500, batch_size=8, lr=2e-3, distill_weight=0.5))
    target_shape: ModelShape = field(default_factory=lambda: TARGET_SHAPE)
    draft_shape: ModelShape = field(default_factory=lambda: DRAFT_SHAPE)
    prompt_lines: int = 24
    target_from: str | None = None
    """reuse this trained target folder instead of training one (e.g. to train another draft)"""


def lr_at(step: int, cfg: StageConfig) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def tokenize_corpus(tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream (uint16 ids): every file's tokens followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    batch = 256
    for i in range(0, len(texts), batch):
        for enc in tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    return np.asarray(ids, dtype=np.uint16 if tokenizer.vocab_size < 65536 else np.int32)


def sample_batch(stream: np.ndarray, cfg: StageConfig, gen: torch.Generator) -> torch.Tensor:
    """Random windows of `seq_len + 1` tokens: [batch_size, seq_len + 1] int64."""
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    rows = [torch.from_numpy(stream[s : s + cfg.seq_len + 1].astype(np.int64)) for s in starts.tolist()]
    return torch.stack(rows)


def _save_checkpoint(path: Path, model: PreTrainedModel, opt: torch.optim.Optimizer, step: int, gen: torch.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "gen": gen.get_state()}, tmp)
    tmp.replace(path)


def train_stage(
    name: str,
    model: PreTrainedModel,
    stream: np.ndarray,
    cfg: StageConfig,
    work_dir: Path,
    seed: int,
    teacher: PreTrainedModel | None = None,
    log: list[dict] | None = None,
) -> PreTrainedModel:
    """Train `model` on random windows of `stream`, checkpointing to `work_dir/{name}.ckpt`.

    With `teacher` and `cfg.distill_weight > 0` the loss is
    `(1 - w) * CE(labels) + w * KL(teacher_probs || model_probs)` per token.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = work_dir / f"{name}.ckpt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        start = state["step"]
    model.train()
    columns = [TextColumn(f"[bold]{name}"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    t0 = time.time()
    with Progress(*columns) as progress:
        task = progress.add_task(name, total=cfg.steps, completed=start, loss=float("nan"))
        for step in range(start, cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            batch = sample_batch(stream, cfg, gen)  # [B, T+1]
            inputs, labels = batch[:, :-1], batch[:, 1:]
            logits = model(inputs).logits  # [B, T, V]
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss = ce
            if teacher is not None and cfg.distill_weight > 0:
                with torch.no_grad():
                    teacher_logprobs = F.log_softmax(teacher(inputs).logits, dim=-1)  # [B, T, V]
                kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), teacher_logprobs.flatten(0, 1), log_target=True, reduction="batchmean")
                loss = (1 - cfg.distill_weight) * ce + cfg.distill_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            progress.update(task, advance=1, loss=ce.item())
            if log is not None and (step % 10 == 0 or step == cfg.steps - 1):
                log.append({"stage": name, "step": step, "ce": ce.item(), "lr": lr_at(step, cfg), "elapsed_s": time.time() - t0})
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                _save_checkpoint(ckpt, model, opt, step + 1, gen)
    model.eval()
    return model


def train_pair(cfg: PairConfig, tokenizer_dir: Path | None = None) -> dict:
    """Train tokenizer (unless `tokenizer_dir` is given), target and draft; return a summary dict.

    Outputs under `cfg.out_dir`: `tokenizer/`, `target/`, `draft/` (float16 safetensors +
    tokenizer), `stdlib-heldout.jsonl`, `heldout_tokens.npy`, `train_log.json`, `pair_config.json`.
    """
    out = Path(cfg.out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (out / "pair_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    t_start = time.time()
    files = list_sources([Path(c) for c in cfg.corpus] or None)
    train_files, heldout_files = split_sources(files)
    if not train_files or not heldout_files:
        raise ValueError(f"corpus has {len(train_files)} train and {len(heldout_files)} held-out files; it needs both (add more files)")
    n_prompts = build_prompt_set(heldout_files, out / "stdlib-heldout.jsonl", prompt_lines=cfg.prompt_lines)

    tok_dir = tokenizer_dir or out / "tokenizer"
    if tokenizer_dir is None and not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(iter_texts(train_files), tok_dir, vocab_size=cfg.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    t_tok = time.time() - t_start

    stream_path, heldout_path = work / "train_tokens.npy", out / "heldout_tokens.npy"
    if stream_path.exists() and heldout_path.exists():
        stream, heldout_stream = np.load(stream_path), np.load(heldout_path)
    else:
        stream = tokenize_corpus(tokenizer, list(iter_texts(train_files)))
        heldout_stream = tokenize_corpus(tokenizer, list(iter_texts(heldout_files)))
        np.save(stream_path, stream)
        np.save(heldout_path, heldout_stream)
    vocab = len(tokenizer)
    log: list[dict] = []
    timings = {"tokenizer_and_data_s": t_tok}

    t0 = time.time()
    if cfg.target_from:
        target = AutoModelForCausalLM.from_pretrained(cfg.target_from, dtype=torch.float32).eval()
    else:
        torch.manual_seed(cfg.seed)
        target = AutoModelForCausalLM.from_config(cfg.target_shape.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id))
        target = train_stage("target", target, stream, cfg.target, work, cfg.seed, log=log)
    timings["target_s"] = time.time() - t0

    t0 = time.time()
    torch.manual_seed(cfg.seed + 1)
    draft = AutoModelForCausalLM.from_config(cfg.draft_shape.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id))
    teacher = target if cfg.draft.distill_weight > 0 else None
    draft = train_stage("draft", draft, stream, cfg.draft, work, cfg.seed + 1, teacher=teacher, log=log)
    timings["draft_s"] = time.time() - t0

    for name, model in (("target", target), ("draft", draft)):
        save_half(model, tokenizer, out / name)
    summary = {
        "train_tokens": int(len(stream)),
        "heldout_tokens": int(len(heldout_stream)),
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "prompts": n_prompts,
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "timings_s": timings,
        "total_s": time.time() - t_start,
    }
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    return summary


def save_half(model: PreTrainedModel, tokenizer, out_dir: Path) -> None:
    """Save `model` as float16 safetensors (loaded back as float32 on CPU) with the tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    half = model.to(torch.float16)
    half.save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(out_dir)


BUNDLE_FILES = ("target", "draft", "stdlib-heldout.jsonl", "train_log.json", "pair_config.json")
"""what `bundle_pair` copies (checkpoints and token caches stay behind)"""


def copy_bundle(source: Path, dest: Path, files: tuple[str, ...], command: str) -> Path:
    """Copy `files` (folders or files) of a finished training run `source` into `dest`."""
    import shutil

    from specdec.errors import SpecDecError

    missing = [name for name in files if not (source / name).exists()]
    if missing:
        raise SpecDecError(f"{source} lacks {', '.join(missing)}; pass the --out folder of a finished `{command}` run")
    dest.mkdir(parents=True, exist_ok=True)
    for name in files:
        src, dst = source / name, dest / name
        if src.is_dir():
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return dest


def bundle_pair(source: Path, dest: Path | None = None) -> Path:
    """Copy a trained pair's shippable files into the package's assets (the bundled pair)."""
    from specdec.models.loading import BUNDLED_PAIR

    return copy_bundle(source, dest or BUNDLED_PAIR, BUNDLE_FILES, "specdec train pair")
