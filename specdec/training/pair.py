"""Train the bundled GPT-NeoX target/draft pair on a code corpus.

`train_pair` runs: tokenizer (unless one is given) -> tokenise corpus -> train target ->
train draft (optionally distilled from the target's logits) -> save both in float16
safetensors with the tokenizer beside each, plus the `stdlib-heldout` prompt set.
Every stage checkpoints periodically and resumes from its last checkpoint, logs its training
loss and a held-out loss curve to JSONL files as it goes, and can warm-start from trained
weights (`init_target`, `init_draft`); `packages` adds installed packages' sources to the
training split (`specdec.training.packages`). docs/bundled-pair.md, "Continuing training".
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, PreTrainedModel

from specdec.training.corpus import SourceFile, build_prompt_set, iter_texts, split_sources, training_split
from specdec.training.packages import package_sources
from specdec.training.tokenizer import train_tokenizer
from specdec.training.unlikelihood import SequenceUnlikelihood, UnlikelihoodConfig


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
"""~2.9M parameters (2.1M of them the tied embedding): one layer keeps a step cheap. The bundled
v2 draft was deepened to two layers (`--draft-layers 2`, 3.7M) so it can copy from its context."""


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
    decay_steps: int | None = None
    """None: cosine decay over all `steps` after warm-up. A number: warm-up, then the peak LR
    held constant, then cosine decay over only the last `decay_steps` steps (a
    warmup-stable-decay schedule). The LR of every step before `steps - decay_steps` does not
    depend on `steps`, so a run can be extended by re-running with a larger `steps`."""
    eval_every: int = 50
    """steps between held-out losses on the fixed held-out sample (when one is given)"""


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
    init_target: str | None = None
    """warm start: initialise the target from this trained model folder (fresh optimizer and schedule)"""
    init_draft: str | None = None
    """warm start: initialise the draft from this trained model folder"""
    draft_layers: int | None = None
    """the draft's decoder layers when asked for (`--draft-layers`): the draft shape's, or a
    deepened `init_draft` (`deepen`); None: the shape's, or the warm start's own"""
    unlikelihood: StageConfig | None = None
    """after the target stage (or `target_from`): fine-tune the target with the next-token loss
    plus sequence-level unlikelihood on its own greedy continuations (`training.unlikelihood`)
    for this many steps; None: no such stage"""
    unlikelihood_loss: UnlikelihoodConfig = field(default_factory=UnlikelihoodConfig)
    packages: bool = False
    """also train on the licence-filtered sources of installed packages (`training.packages`)"""
    site_packages: str | None = None
    """the site-packages folder for `packages` (None: the running interpreter's)"""
    heldout_sample_windows: int = 16
    """windows of seq_len tokens in the fixed held-out sample scored every `eval_every` steps"""


def lr_at(step: int, cfg: StageConfig) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio * lr`: over all remaining steps, or
    with `decay_steps` only over the last `decay_steps` (constant peak LR before them)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay_steps is not None:
        decay_start = max(cfg.warmup_steps, cfg.steps - cfg.decay_steps)
        progress = (step - decay_start) / max(1, cfg.steps - decay_start) if step >= decay_start else 0.0
    else:
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def tokenize_corpus(tokenizer, texts: Iterable[str]) -> np.ndarray:
    """One token stream (uint16 ids): every file's tokens followed by EOS.

    Built in numpy chunks of 256 files, so tens of millions of tokens stay cheap in memory."""
    eos = tokenizer.eos_token_id
    dtype = np.uint16 if len(tokenizer) < 65536 else np.int32
    chunks: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        ids: list[int] = []
        for enc in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
        chunks.append(np.asarray(ids, dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            flush()
    if batch:
        flush()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def heldout_sample(stream: np.ndarray, windows: int, seq_len: int, max_tokens: int = 65536) -> torch.Tensor:
    """A fixed held-out sample: `windows` rows of `seq_len + 1` tokens, evenly spaced over the
    non-overlapping windows of the first `max_tokens` tokens that `specdec train evaluate` scores
    (a subset of its windows, so the two figures are comparable). [windows, seq_len + 1] int64."""
    if len(stream) < seq_len + 1:
        from specdec.errors import SpecDecError

        raise SpecDecError(f"the held-out stream has {len(stream)} tokens, fewer than --seq-len + 1 = {seq_len + 1}; use a shorter --seq-len or --heldout-windows 0")
    available = max(1, min(len(stream) - 1, max_tokens) // seq_len)
    picks = sorted({int(i * available / windows) for i in range(min(windows, available))})
    return torch.stack([torch.from_numpy(stream[w * seq_len : w * seq_len + seq_len + 1].astype(np.int64)) for w in picks])


@torch.inference_mode()
def sample_loss(model: PreTrainedModel, sample: torch.Tensor, batch: int = 4) -> float:
    """Mean next-token cross-entropy (nats) of `model` on a held-out sample [N, T + 1]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(sample), batch):
        rows = sample[i : i + batch]
        logits = model(rows[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    model.train(was_training)
    return total / count


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
    eval_sample: torch.Tensor | None = None,
    on_checkpoint: Callable[[PreTrainedModel, int], None] | None = None,
    extra_loss: Callable[[PreTrainedModel, torch.Generator], tuple[torch.Tensor, dict[str, float]]] | None = None,
) -> PreTrainedModel:
    """Train `model` on random windows of `stream`, checkpointing to `work_dir/{name}.ckpt`.

    With `teacher` and `cfg.distill_weight > 0` the loss is
    `(1 - w) * CE(labels) + w * KL(teacher_probs || model_probs)` per token.

    Every record of `log` (training loss) is also appended to `work_dir/{name}_log.jsonl` as it
    is made, so an interrupted run keeps its history. With `eval_sample` ([N, T + 1] held-out tokens) the
    held-out loss is measured every `cfg.eval_every` steps (and at the last step) and
    appended to `work_dir/{name}_heldout.jsonl` as `{"step", "heldout_loss",
    "heldout_ppl", "lr", "elapsed_s", "time"}`; `step` counts optimizer steps done.
    `on_checkpoint(model, step)` runs after each checkpoint (e.g. to save a loadable snapshot).
    `extra_loss(model, generator)` adds a term to every step's loss (drawing what it needs
    with the stage's generator, so a resumed run draws the same) and fields to its log rows
    (`unlikelihood.SequenceUnlikelihood`).
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
    log_path, curve_path = work_dir / f"{name}_log.jsonl", work_dir / f"{name}_heldout.jsonl"

    def record(path: Path, row: dict) -> None:
        with path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def evaluate(step: int) -> None:
        loss = sample_loss(model, eval_sample)
        row = {"step": step, "heldout_loss": loss, "heldout_ppl": math.exp(loss), "lr": lr_at(max(0, step - 1), cfg),
               "elapsed_s": time.time() - t0, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        record(curve_path, row)
        rate = (step - start) / max(1e-9, row["elapsed_s"]) * 3600
        progress.console.print(
            f"{row['time']} {name} step {step}: held-out loss {loss:.4f} (perplexity {row['heldout_ppl']:.2f}), "
            f"train loss {last_ce:.3f}, lr {row['lr']:.2e}, {rate:.0f} steps/h", highlight=False, soft_wrap=True
        )

    last_ce = float("nan")
    columns = [TextColumn(f"[bold]{name}"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    t0 = time.time()
    with Progress(*columns) as progress:
        task = progress.add_task(name, total=cfg.steps, completed=start, loss=float("nan"))
        logged = {json.loads(line)["step"] for line in curve_path.read_text().splitlines()} if curve_path.exists() else set()
        if eval_sample is not None and start < cfg.steps and start not in logged:
            evaluate(start)
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
            extra: dict[str, float] = {}
            if extra_loss is not None:
                term, extra = extra_loss(model, gen)
                loss = loss + term
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            last_ce = ce.item()
            progress.update(task, advance=1, loss=last_ce)
            if step % 10 == 0 or step == cfg.steps - 1:
                row = {"stage": name, "step": step, "ce": ce.item(), **extra, "lr": lr_at(step, cfg), "elapsed_s": time.time() - t0}
                record(log_path, row)
                if log is not None:
                    log.append(row)
            if eval_sample is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                evaluate(step + 1)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                _save_checkpoint(ckpt, model, opt, step + 1, gen)
                if on_checkpoint is not None:
                    on_checkpoint(model, step + 1)
    model.eval()
    return model


def train_pair(cfg: PairConfig, tokenizer_dir: Path | None = None) -> dict:
    """Train tokenizer (unless `tokenizer_dir` is given), target and draft; return a summary dict.

    Outputs under `cfg.out_dir`: `tokenizer/`, `target/`, `draft/` (float16 safetensors +
    tokenizer), `stdlib-heldout.jsonl`, `heldout_tokens.npy`, `train_log.json`, `pair_config.json`.
    """
    out = Path(cfg.out_dir)
    work = out / "work"
    t_start = time.time()
    train_files, heldout_files = training_split([Path(c) for c in cfg.corpus] or None)  # a corpus without both splits fails before anything is written
    files = sorted(train_files + heldout_files, key=lambda f: f.module)  # list_sources order
    work.mkdir(parents=True, exist_ok=True)
    (out / "pair_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    n_prompts = build_prompt_set(heldout_files, out / "stdlib-heldout.jsonl", prompt_lines=cfg.prompt_lines)
    package_train: list[SourceFile] = []
    corpus_info: dict = {}
    if cfg.packages:
        packages = package_sources(Path(cfg.site_packages) if cfg.site_packages else None, corpus=files, heldout=heldout_files)
        package_train, package_heldout = split_sources(packages.files)
        corpus_info["packages"] = {**packages.summary(), "train_files": len(package_train), "heldout_files_unused": len(package_heldout)}

    tok_dir = tokenizer_dir or out / "tokenizer"
    if tokenizer_dir is None and not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(iter_texts(train_files), tok_dir, vocab_size=cfg.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)

    stream_path, heldout_path, manifest_path = work / "train_tokens.npy", out / "heldout_tokens.npy", work / "corpus.json"
    fingerprint = _corpus_fingerprint(train_files + package_train, heldout_files, tokenizer)
    cached = manifest_path.exists() and json.loads(manifest_path.read_text()).get("fingerprint") == fingerprint
    if stream_path.exists() and heldout_path.exists() and (cached or not manifest_path.exists() and not cfg.packages):
        stream, heldout_stream = np.load(stream_path, mmap_mode="r"), np.load(heldout_path)
    else:
        base_stream = tokenize_corpus(tokenizer, iter_texts(train_files))
        package_stream = tokenize_corpus(tokenizer, iter_texts(package_train))
        stream = np.concatenate([base_stream, package_stream])
        heldout_stream = tokenize_corpus(tokenizer, iter_texts(heldout_files))
        np.save(stream_path, stream)
        np.save(heldout_path, heldout_stream)
        corpus_info.update(
            fingerprint=fingerprint,
            base_train_files=len(train_files),
            base_train_tokens=int(len(base_stream)),
            package_train_files=len(package_train),
            package_train_tokens=int(len(package_stream)),
            heldout_files=len(heldout_files),
            heldout_tokens=int(len(heldout_stream)),
        )
        manifest_path.write_text(json.dumps(corpus_info, indent=1))
    vocab = len(tokenizer)
    log: list[dict] = []
    timings = {"tokenizer_and_data_s": time.time() - t_start}
    sample = heldout_sample(heldout_stream, cfg.heldout_sample_windows, cfg.target.seq_len) if cfg.heldout_sample_windows > 0 else None

    t0 = time.time()
    if cfg.target_from:
        target = AutoModelForCausalLM.from_pretrained(cfg.target_from, dtype=torch.float32).eval()
    else:
        if cfg.init_target:
            target = load_init(cfg.init_target, tokenizer, "--init-target")
        else:
            torch.manual_seed(cfg.seed)
            target = AutoModelForCausalLM.from_config(cfg.target_shape.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id))
        target = train_stage(
            "target", target, stream, cfg.target, work, cfg.seed, log=log, eval_sample=sample,
            on_checkpoint=lambda model, step: save_snapshot(model, tokenizer, work / "target-latest", step),
        )
    timings["target_s"] = time.time() - t0
    if cfg.unlikelihood is not None and cfg.unlikelihood.steps > 0:
        t0 = time.time()
        target = train_stage(
            "unlikelihood", target, stream, cfg.unlikelihood, work, cfg.seed + 2, log=log, eval_sample=sample,
            on_checkpoint=lambda model, step: save_snapshot(model, tokenizer, work / "unlikelihood-latest", step),
            extra_loss=SequenceUnlikelihood(stream, cfg.unlikelihood_loss),
        )
        timings["unlikelihood_s"] = time.time() - t0

    t0 = time.time()
    if cfg.init_draft:
        draft = load_init(cfg.init_draft, tokenizer, "--init-draft")
        if cfg.draft_layers is not None:
            draft = deepen(draft, cfg.draft_layers, cfg.seed + 1, "--init-draft")
    else:
        torch.manual_seed(cfg.seed + 1)
        draft = AutoModelForCausalLM.from_config(cfg.draft_shape.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id))
    teacher = target if cfg.draft.distill_weight > 0 else None
    draft = train_stage(
        "draft", draft, stream, cfg.draft, work, cfg.seed + 1, teacher=teacher, log=log, eval_sample=sample,
        on_checkpoint=lambda model, step: save_snapshot(model, tokenizer, work / "draft-latest", step),
    )
    timings["draft_s"] = time.time() - t0

    for name, model in (("target", target), ("draft", draft)):
        save_half(model, tokenizer, out / name)
    summary = {
        "train_tokens": int(len(stream)),
        "heldout_tokens": int(len(heldout_stream)),
        "train_files": len(train_files) + len(package_train),
        "heldout_files": len(heldout_files),
        "prompts": n_prompts,
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "corpus": json.loads(manifest_path.read_text()) if manifest_path.exists() else {},
        "timings_s": timings,
        "total_s": time.time() - t_start,
    }
    curves = {name: [json.loads(line) for line in path.read_text().splitlines()] for name in ("target", "unlikelihood", "draft") if (path := work / f"{name}_heldout.jsonl").exists()}
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log, "heldout_curve": curves}, indent=1))
    return summary


def _corpus_fingerprint(train: list[SourceFile], heldout: list[SourceFile], tokenizer) -> str:
    """Identifies the token caches: file lists with sizes and the tokenizer's vocabulary size."""
    h = hashlib.sha1(f"{len(tokenizer)}|{tokenizer.eos_token_id}".encode())
    for tag, files in (("train", train), ("heldout", heldout)):
        for f in files:
            h.update(f"{tag}|{f.module}|{f.path.stat().st_size}\n".encode())
    return h.hexdigest()


def load_init(folder: str, tokenizer, flag: str) -> PreTrainedModel:
    """A trained model to warm-start from (float32, train mode), checked against the tokenizer."""
    from specdec.errors import SpecDecError

    if not (Path(folder) / "config.json").exists():
        raise SpecDecError(f"{flag} {folder} is not a model folder (no config.json); pass a trained model folder such as specdec/assets/pair/target")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    own = AutoTokenizer.from_pretrained(folder).get_vocab() if (Path(folder) / "tokenizer.json").exists() else None
    if model.config.vocab_size != len(tokenizer) or (own is not None and own != tokenizer.get_vocab()):
        raise SpecDecError(
            f"{flag} {folder} was trained with another tokenizer ({model.config.vocab_size} tokens; this run's has {len(tokenizer)} "
            f"or maps them differently); pass --tokenizer {folder} so the warm start keeps its own tokenizer"
        )
    return model


def deepen(model: PreTrainedModel, layers: int, seed: int, flag: str) -> PreTrainedModel:
    """`model` with `layers` decoder layers, computing the same function: its layers are kept and
    each new one (appended after them, before the final norm) starts from a fresh initialisation
    with the projections that write into the residual stream zeroed (attention and MLP output
    projections, `synthetic.OUTPUT_PROJECTIONS`), so it adds nothing until trained. A warm start
    for a deeper draft: a one-layer draft cannot copy from its context (induction needs two
    layers), which on repetitive code is most of what a draft must predict."""
    from specdec.errors import SpecDecError
    from specdec.models.synthetic import OUTPUT_PROJECTIONS, _layer_of, _module_of, num_layers, with_layers

    have = num_layers(model.config)
    if layers == have:
        return model
    if layers < have:
        raise SpecDecError(f"{flag} has {have} layers and --draft-layers asks for {layers}; pass --draft-layers {have} or more")
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(with_layers(model.config, layers), dtype=torch.float32)
    missing, unexpected = deeper.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any((_layer_of(name) or 0) < have for name in missing):
        raise SpecDecError(f"{flag}: cannot deepen a {model.config.model_type!r} model by name (unexpected {unexpected[:3]}, missing {missing[:3]})")
    zeroed = 0
    with torch.no_grad():
        for name, param in deeper.named_parameters():
            layer = _layer_of(name)
            if layer is not None and layer >= have and _module_of(name) in OUTPUT_PROJECTIONS:
                param.zero_()
                zeroed += 1
    if zeroed < 2 * (layers - have):
        raise SpecDecError(f"{flag}: found no attention/MLP output projections to zero in the new layers of a {model.config.model_type!r} model")
    return deeper


def save_snapshot(model: PreTrainedModel, tokenizer, dest: Path, step: int) -> None:
    """Replace `dest` with a loadable float16 copy of `model` (and `step.txt`), written beside it first."""
    import copy

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_half(copy.deepcopy(model), tokenizer, tmp)  # a copy: the float16 round trip must not touch the trained weights
    (tmp / "step.txt").write_text(f"{step}\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


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
