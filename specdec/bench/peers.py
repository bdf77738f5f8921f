"""Hugging Face `generate()` peers, timed the same way as the engine's calls.

- `hf`: plain `target.generate()`;
- `hf-assisted`: `target.generate(assistant_model=draft)` (HF's speculative decoding);
- `hf-lookup`: `target.generate(prompt_lookup_num_tokens=10)` (prompt-lookup decoding).
Peers run one prompt at a time (batch size 1), except `hf`, which also runs a batch of text
prompts in one left-padded `generate()` call (`run_peer_batch`: HF's own batched decoding, to
set our batched AR against); new tokens are the output length minus the prompt length, cut after
the first EOS. They report no TTFT, τ or acceptance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from specdec.hostwork import sync_device
from specdec.padding import pad_rows
from specdec.sampling import SamplingParams

PROMPT_LOOKUP_TOKENS = 10
"""`prompt_lookup_num_tokens` of the hf-lookup peer"""


@dataclass
class PeerOutput:
    """One peer generation."""

    token_ids: list[int]
    """generated tokens only (EOS included when it ended the sequence)"""
    finish_reason: str
    """'eos' or 'length'"""
    wall_s: float

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


BATCHED_PEERS = ("hf",)
"""peers that run at batch sizes above 1 (HF's assisted and prompt-lookup decoding take one row)"""


def peer_needs_draft(name: str) -> bool:
    """Whether the peer uses the draft model."""
    return name == "hf-assisted"


def peer_kwargs(name: str, draft: PreTrainedModel | None) -> dict[str, Any]:
    """The `generate()` keyword arguments that make `name` what it is."""
    if name == "hf":
        return {}
    if name == "hf-assisted":
        if draft is None:
            raise ValueError("hf-assisted needs a draft model")
        return {"assistant_model": draft}
    if name == "hf-lookup":
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    raise ValueError(f"unknown peer {name!r}")


def run_peer(
    name: str,
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: list[int],
    pad_token_id: int,
    seed: int | None = None,
    assistant_start: int | None = None,
) -> PeerOutput:
    """One timed `target.generate()` call of peer `name` on one prompt (token ids).

    assistant_start: hf-assisted's starting draft length (`num_assistant_tokens`; None = HF's default),
    restored before the call.
    """
    device = next(target.parameters()).device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, L]
    attention_mask = torch.ones_like(input_ids)  # [1, L]
    extra = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in getattr(prompt_ids, "model_inputs", {}).items()}  # pixel values
    kwargs = peer_kwargs(name, draft)
    if draft is not None and name == "hf-assisted":
        # HF's "heuristic" schedule writes the adapted draft length back into the draft's
        # generation_config after each call; restore the starting value so calls are independent
        # (otherwise each call's figures would depend on the interleaved order of the ones before).
        draft.generation_config.num_assistant_tokens = assistant_start
    out, wall = _timed_generate(target, input_ids, attention_mask, max_new_tokens, params, eos_token_ids, pad_token_id, seed, {**kwargs, **extra})  # [1, L + new]
    return _cut_at_eos(out[0, input_ids.shape[1] :].tolist(), eos_token_ids, wall)


def _timed_generate(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    seed: int | None,
    extra: dict[str, Any],
) -> tuple[torch.Tensor, float]:
    """`target.generate()` on [B, L] inputs with the sampling params, timed from outside with the
    device synchronised on both sides; returns the output ids [B, L + new] and the wall time."""
    sampling: dict[str, Any] = {"do_sample": False} if params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or None,
    }
    device = input_ids.device
    if seed is not None:
        torch.manual_seed(seed)
    sync_device(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_token_ids) or None, pad_token_id=pad_token_id, **sampling, **extra,
        )
    sync_device(device)
    return out, time.perf_counter() - t0


def _cut_at_eos(tokens: list[int], eos_token_ids: Sequence[int], wall: float) -> PeerOutput:
    """A row's generated tokens up to and with its first EOS (HF pads finished rows after it)."""
    eos = set(eos_token_ids)
    for i, tok in enumerate(tokens):
        if tok in eos:
            return PeerOutput(token_ids=tokens[: i + 1], finish_reason="eos", wall_s=wall)
    return PeerOutput(token_ids=tokens, finish_reason="length", wall_s=wall)


def run_peer_batch(
    name: str,
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: list[int],
    pad_token_id: int,
    seed: int | None = None,
) -> tuple[list[PeerOutput], float]:
    """One timed `target.generate()` call of peer `name` (in `BATCHED_PEERS`) on a batch of text
    prompts, left-padded with `pad_token_id` and masked. Returns each row's output and the call's
    wall time."""
    if name not in BATCHED_PEERS:
        raise ValueError(f"peer {name!r} runs only at batch size 1")
    device = next(target.parameters()).device
    input_ids, attention_mask = (t.to(device) for t in pad_rows(prompts, pad_token_id, side="left"))  # [B, L] each
    width = input_ids.shape[1]
    out, wall = _timed_generate(target, input_ids, attention_mask, max_new_tokens, params, eos_token_ids, pad_token_id, seed, peer_kwargs(name, None))  # [B, L + new]
    return [_cut_at_eos(row[width:].tolist(), eos_token_ids, wall) for row in out], wall
