"""Figures for the bundled pair's model card: held-out perplexity, draft/target top-1
agreement, and forward latency of each model through the engine's runner."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from specdec.errors import SpecDecError
from specdec.models.runner import ModelRunner
from specdec.training.corpus import iter_texts, list_sources, split_sources
from specdec.training.pair import tokenize_corpus


def heldout_texts(corpus: list[Path] | None = None) -> list[str]:
    """The texts of the held-out split (same split as training); a SpecDecError naming the
    corpus when there are none (no files, only empty or binary ones, or none held out)."""
    files = list_sources(corpus)
    _, heldout = split_sources(files)
    texts = list(iter_texts(heldout))
    if texts:
        return texts
    named = "--corpus " + " ".join(repr(str(p)) for p in corpus) if corpus else "the standard library"
    if not files:
        why = "it holds no .py files"
    elif not any(True for _ in iter_texts(files)):
        why = f"its {len(files)} file(s) hold no UTF-8 text (empty or binary)"
    else:
        why = (
            f"its held-out split (a hash-chosen share of its {len(files)} file(s), the same as in training) holds no text; "
            "a corpus needs at least two files with text"
        )
    raise SpecDecError(f"{named} yields no tokens to score: {why}; give the corpus the pair was trained on")


def heldout_stream(tokenizer, corpus: list[Path] | None = None, texts: list[str] | None = None) -> np.ndarray:
    """Token stream of the held-out split (same split as training); `texts`: that split's
    texts when already read (`heldout_texts`)."""
    return tokenize_corpus(tokenizer, texts if texts is not None else heldout_texts(corpus))


@torch.inference_mode()
def perplexity_and_agreement(target: PreTrainedModel, draft: PreTrainedModel, stream: np.ndarray, window: int = 512, max_tokens: int = 65536) -> dict:
    """Perplexity of each model and the draft's top-1 agreement with the target over
    non-overlapping windows of the held-out stream (every position after the first)."""
    nll = {"target": 0.0, "draft": 0.0}
    agree = 0
    count = 0
    n_windows = max(1, min(len(stream) - 1, max_tokens) // window)
    for w in range(n_windows):
        chunk = torch.from_numpy(stream[w * window : (w + 1) * window + 1].astype(np.int64))[None]  # [1, window + 1]
        inputs, labels = chunk[:, :-1].to(target.device), chunk[:, 1:].to(target.device)
        t_logits = target(inputs).logits.float()  # [1, T, V]
        d_logits = draft(inputs.to(draft.device)).logits.float().to(target.device)
        for name, logits in (("target", t_logits), ("draft", d_logits)):
            nll[name] += torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum").item()
        agree += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        count += labels.numel()
    return {
        "tokens": count,
        "target_perplexity": float(np.exp(nll["target"] / count)),
        "draft_perplexity": float(np.exp(nll["draft"] / count)),
        "top1_agreement": agree / count,
    }


@torch.inference_mode()
def greedy_loop_share(model: PreTrainedModel, tokenizer, prompts: list[str], max_new_tokens: int = 128) -> dict:
    """Share of greedy completions (plain `generate`, `max_new_tokens` each, EOS dropped) that
    end in a short loop (`specdec.stats.ends_in_loop`, the `loops` figure of `specdec bench
    --quality`), with each prompt's flag."""
    from specdec.stats import ends_in_loop, loop_share

    eos = tokenizer.eos_token_id
    flags = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        flags.append(ends_in_loop([t for t in out[0, ids.shape[1] :].tolist() if t != eos]))
    return {"loop_share": loop_share(flags), "loop_prompts": len(flags), "loop_max_new_tokens": max_new_tokens, "loops": flags}


def forward_latency_ms(model: PreTrainedModel, context: int = 512, new_tokens: tuple[int, ...] = (1, 16, 64), repeats: int = 20) -> dict[int, float]:
    """Median wall time (ms) of one engine forward of n new tokens (causal among themselves)
    after `context` committed tokens, for each n; the step slots are rolled back each time."""
    runner = ModelRunner(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(runner.device)
    runner.prefill(ids, torch.ones_like(ids))
    out = {}
    for n in new_tokens:
        tokens = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(runner.device)
        positions = torch.arange(context, context + n, device=runner.device)[None]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=runner.device))[None]
        times = []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            runner.forward(tokens, positions, causal)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            runner.rollback()
            if i >= 3:  # warm-up
                times.append(elapsed)
        out[n] = statistics.median(times) * 1e3
    return out


def evaluate_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer,
    corpus: list[Path] | None = None,
    max_tokens: int = 65536,
    window: int = 512,
    latency_context: int = 512,
    latency: bool = True,
    texts: list[str] | None = None,
) -> dict:
    """Model-card figures: held-out perplexity of both models, top-1 agreement, forward latency
    after `latency_context` tokens of context (1-, 16- and 64-token forwards; not with `latency=False`).
    texts: the corpus's held-out texts when already read (`heldout_texts`)."""
    stream = heldout_stream(tokenizer, corpus, texts)
    quality = perplexity_and_agreement(target, draft, stream, window=window, max_tokens=max_tokens)
    if not latency:
        return {"target_params": sum(p.numel() for p in target.parameters()), "draft_params": sum(p.numel() for p in draft.parameters()), **quality}
    latency = {name: forward_latency_ms(model, context=latency_context) for name, model in (("target", target), ("draft", draft))}
    return {
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        **quality,
        "latency_ms": latency,
        "draft_to_target_1token_ratio": latency["draft"][1] / latency["target"][1],
        "threads": torch.get_num_threads(),
    }
