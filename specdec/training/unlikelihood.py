"""Sequence-level unlikelihood training against degenerate repetition (Welleck et al. 2020,
"Neural Text Generation with Unlikelihood Training", ICLR; section 5.2).

A small language model trained by maximum likelihood alone assigns its greedy continuations
ever more probability as they repeat themselves, so greedy decoding falls into loops
(`_get_get_get…`, `#\\n#\\n…`). Sequence-level unlikelihood fine-tunes it on its *own*
greedy continuations: for a batch of prefixes drawn from the training stream it decodes
`continuation_len` tokens greedily, marks every token that belongs to an n-gram which already
occurred earlier in the continuation (`repeat_mask`, n = 4 as in the paper), and adds

    L_UL = - sum over marked positions t of log(1 - p(x_t | x_<t))   (averaged over the marked ones)

to the ordinary next-token loss of the same step (the paper mixes the two; the next-token loss
keeps the model's perplexity). Only repeats inside the continuation are penalised, never the
prefix: code legitimately repeats what is in its context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from specdec.models.support import cache_argument, output_cache


@dataclass
class UnlikelihoodConfig:
    """The sequence-level unlikelihood term of a fine-tuning step."""

    prefix_len: int = 64
    """tokens of each prefix (a random window of the training stream)"""
    continuation_len: int = 96
    """greedy tokens decoded after each prefix (the loops the loss acts on)"""
    batch_size: int = 4
    """prefixes per step"""
    ngram: int = 4
    """a token is penalised when it is part of an n-gram already seen in its continuation"""
    weight: float = 1.0
    """weight of the unlikelihood term beside the next-token loss"""

    def validate(self) -> None:
        for name in ("prefix_len", "continuation_len", "batch_size", "ngram"):
            if getattr(self, name) < 1:
                raise ValueError(f"unlikelihood {name} must be >= 1 (got {getattr(self, name)})")
        if self.weight < 0:
            raise ValueError(f"unlikelihood weight must be >= 0 (got {self.weight})")


def repeat_mask(tokens: list[int], n: int) -> list[bool]:
    """Per token: whether it belongs to an n-gram of `tokens` that occurred earlier in `tokens`
    (every token of the repeated n-gram is marked). Example, n = 2: [1, 2, 1, 2, 3] ->
    [False, False, True, True, False]."""
    mask = [False] * len(tokens)
    seen: set[tuple[int, ...]] = set()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        if gram in seen:
            for j in range(i, i + n):
                mask[j] = True
        seen.add(gram)
    return mask


@torch.no_grad()
def greedy_continuations(model: PreTrainedModel, prefix: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] greedy tokens after `prefix` [B, P] (with the KV cache; EOS does not stop it:
    the loss looks at what the model would go on to say)."""
    name = cache_argument(model)  # 'cache' (transformers >= 5.24) or 'past_key_values'
    out = model(prefix, use_cache=True)
    past = output_cache(out)
    token = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
    tokens = [token]
    for _ in range(length - 1):
        out = model(token, use_cache=True, **{name: past})
        past = output_cache(out)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


class SequenceUnlikelihood:
    """The unlikelihood term of one step (`train_stage`'s `extra_loss`): draws prefixes from
    `stream` with the stage's generator, decodes, and returns (weighted loss, log fields)."""

    def __init__(self, stream: np.ndarray, cfg: UnlikelihoodConfig) -> None:
        cfg.validate()
        if len(stream) <= cfg.prefix_len + 1:
            raise ValueError(f"the token stream ({len(stream)} tokens) is shorter than an unlikelihood prefix ({cfg.prefix_len})")
        self.stream, self.cfg = stream, cfg

    def __call__(self, model: PreTrainedModel, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        starts = torch.randint(0, len(self.stream) - cfg.prefix_len, (cfg.batch_size,), generator=gen)
        prefix = torch.stack([torch.from_numpy(self.stream[s : s + cfg.prefix_len].astype(np.int64)) for s in starts.tolist()])  # [B, P]
        dev = next(model.parameters()).device
        prefix = prefix.to(dev)
        was_training = model.training
        model.eval()
        continuation = greedy_continuations(model, prefix, cfg.continuation_len)  # [B, L]
        model.train(was_training)
        marked = torch.tensor([repeat_mask(row, cfg.ngram) for row in continuation.tolist()], dtype=torch.bool, device=dev)  # [B, L]
        sequence = torch.cat([prefix, continuation], dim=1)  # [B, P + L]
        logits = model(sequence[:, :-1]).logits[:, cfg.prefix_len - 1 :]  # [B, L, V]: the predictions of the continuation's tokens
        logp = torch.log_softmax(logits.float(), dim=-1).gather(2, continuation[:, :, None]).squeeze(2)  # [B, L]
        one_minus = torch.clamp(1.0 - logp.exp(), min=1e-5)
        count = int(marked.sum())
        loss = -(torch.log(one_minus) * marked).sum() / max(count, 1)
        return cfg.weight * loss, {"ul": float(loss.detach()), "repeat_share": count / marked.numel()}
