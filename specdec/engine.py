"""The decode loop: prefill -> (draft -> verify -> commit -> adapt)* until EOS or the token budget.

One loop serves every method: the tree policy decides the shape, the draft source gives
draft distributions, the accept rule picks the path. Plain autoregressive decoding is the
policy that drafts nothing (each step verifies only the root). Rows of a batch are decoded
together; each keeps its own tree, acceptance and stopping point.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdec.drafting.base import TreePolicy
from specdec.drafting.builder import DraftContext
from specdec.errors import SpecDecError
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams, choose_tokens
from specdec.sources.base import DraftSource
from specdec.stats import GenerationStats, StepRecord
from specdec.verification.base import AcceptRule

StreamCallback = Callable[[int, list[int]], None]
"""stream(row, new_token_ids) is called with every row's newly committed tokens."""


@dataclass
class EngineOutput:
    """One row's result."""

    token_ids: list[int]
    """generated tokens only (prompt excluded), EOS included when it ended the sequence"""
    finish_reason: str
    """'eos' or 'length'"""
    stats: GenerationStats
    steps: list[StepRecord] = field(default_factory=list)


class SpeculativeEngine:
    """Target model + tree policy + draft source + accept rule."""

    def __init__(
        self,
        target: PreTrainedModel,
        policy: TreePolicy,
        rule: AcceptRule,
        source: DraftSource | None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        max_context: int | None = None,
    ) -> None:
        if policy.uses_draft and source is None:
            raise SpecDecError(f"method {policy.name!r} needs a draft model; pass --draft or use --method ar")
        self.target = ModelRunner(target)
        self.policy = policy
        self.rule = rule
        self.source = source if policy.uses_draft else None
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_context = max_context
        self.device = self.target.device

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise SpecDecError("no prompts given; pass at least one prompt")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise SpecDecError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise SpecDecError(f"prompt {i} is empty (0 tokens); give at least one token of text")
            if self.max_context is not None and len(prompt) + max_new_tokens > self.max_context:
                if len(prompt) >= self.max_context:
                    raise SpecDecError(f"prompt {i} has {len(prompt)} tokens but the model's context is {self.max_context}; shorten the prompt")
                raise SpecDecError(
                    f"prompt {i} ({len(prompt)} tokens) + max_new_tokens={max_new_tokens} exceeds the model's context of "
                    f"{self.max_context} tokens; lower max_new_tokens to at most {self.max_context - len(prompt)}"
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        seed: int | None = None,
        stream: StreamCallback | None = None,
        keep_steps: bool = False,
    ) -> list[EngineOutput]:
        """Decode every prompt (token ids) together as one batch."""
        params = params or SamplingParams()
        self._validate(prompts, max_new_tokens)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        elif not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.seed()
        b = len(prompts)
        stats = [GenerationStats(prompt_tokens=len(p)) for p in prompts]
        outputs: list[list[int]] = [[] for _ in range(b)]
        finish = ["length"] * b
        records: list[StepRecord] = []
        forward_s0 = self.target.forward_s + (self.source.runner.forward_s if self._has_runner() else 0.0)

        t_start = time.perf_counter()
        ids, mask = self._left_pad(prompts)
        target_logits = self.target.prefill(ids, mask)  # [B, V]
        if self.source is not None:
            self.source.prefill(ids, mask)
        roots = choose_tokens(target_logits, params, generator)  # [B]
        t_first = time.perf_counter()
        active = torch.ones(b, dtype=torch.bool)
        for row in range(b):
            stats[row].ttft_s = stats[row].prefill_s = t_first - t_start
            self._append(row, [int(roots[row])], outputs, finish, active, max_new_tokens, stream)

        step = 0
        while bool(active.any()):
            remaining = max(max_new_tokens - len(outputs[row]) for row in range(b) if active[row])
            ctx = DraftContext(
                params=params,
                generator=generator,
                max_depth=max(0, remaining - 1),
                active=active.to(self.device),
                context_len=self.target.committed_len(),
            )
            t0 = time.perf_counter()
            tree, builder, origin = self.policy.draft(self.source, roots, ctx)
            t1 = time.perf_counter()
            positions = self.target.committed_len()[:, None] + tree.depths  # [B, N]
            logits = self.target.forward(tree.tokens, positions, tree.ancestor_mask())  # [B, N, V]
            verdict = self.rule.verify(tree, logits, params, generator)
            t2 = time.perf_counter()
            self._commit(tree, verdict.accepted_nodes)
            if builder is not None and self.source is not None:
                self.source.end_step(builder, [origin[row, path].tolist() if path else [] for row, path in enumerate(verdict.accepted_nodes)])
            committed = [0] * b
            was_active = active.tolist()
            for row in range(b):
                if not was_active[row]:
                    continue
                new = tree.tokens[row, verdict.accepted_nodes[row]].tolist() + [int(verdict.bonus_tokens[row])]
                committed[row] = self._append(row, new, outputs, finish, active, max_new_tokens, stream)
            drafted = tree.drafted_per_row().tolist()
            depth_counts = self._drafted_by_depth(tree)
            record = StepRecord(
                step=step,
                active=was_active,
                drafted=[d if a else 0 for d, a in zip(drafted, was_active, strict=True)],
                accepted_len=[len(p) if a else 0 for p, a in zip(verdict.accepted_nodes, was_active, strict=True)],
                committed=committed,
                relaxed=verdict.relaxed,
                strict_fallbacks=verdict.strict_fallbacks,
                tree_depth=tree.max_depth(),
                draft_s=t1 - t0,
                verify_s=t2 - t1,
                drafted_by_depth=depth_counts,
                accepted_depth=[len(p) for p in verdict.accepted_nodes],
            )
            for row in range(b):
                if was_active[row]:
                    stats[row].add_step(record, row)
                    stats[row].draft_s += record.draft_s
                    stats[row].verify_s += record.verify_s
            if keep_steps:
                records.append(record)
            self.policy.feedback(record)
            if self.source is not None:
                self.source.feedback(record)
            roots = verdict.bonus_tokens.to(self.device)
            step += 1

        wall = time.perf_counter() - t_start
        forward_s = self.target.forward_s + (self.source.runner.forward_s if self._has_runner() else 0.0) - forward_s0
        results = []
        for row in range(b):
            stats[row].wall_s = wall
            stats[row].new_tokens = len(outputs[row])
            stats[row].forward_s = forward_s
            results.append(EngineOutput(token_ids=outputs[row], finish_reason=finish[row], stats=stats[row], steps=records))
        return results

    def _has_runner(self) -> bool:
        return self.source is not None and hasattr(self.source, "runner")

    def _commit(self, tree, accepted_nodes: list[list[int]]) -> None:
        """Keep the root and the accepted path in the target cache (their KV from the verify forward)."""
        width = 1 + max(len(p) for p in accepted_nodes)
        keep = torch.zeros(tree.batch_size, width, dtype=torch.long, device=self.device)
        keep_valid = torch.zeros(tree.batch_size, width, dtype=torch.bool, device=self.device)
        for row, path in enumerate(accepted_nodes):
            keep[row, : 1 + len(path)] = torch.tensor([0, *path], dtype=torch.long)
            keep_valid[row, : 1 + len(path)] = True
        self.target.commit(keep, keep_valid)

    @staticmethod
    def _drafted_by_depth(tree) -> list[list[int]]:
        depth = tree.max_depth()
        if depth == 0:
            return [[] for _ in range(tree.batch_size)]
        valid_depths = tree.depths.masked_fill(~tree.valid, 0)
        counts = torch.stack([(valid_depths == d).sum(dim=1) for d in range(1, depth + 1)], dim=1)  # [B, depth]
        return counts.tolist()

    def _append(self, row, new, outputs, finish, active, max_new_tokens, stream) -> int:
        """Append `new` to a row, cutting at EOS and at the token budget; returns how many were kept."""
        room = max_new_tokens - len(outputs[row])
        kept = new[:room]
        for i, tok in enumerate(kept):
            if tok in self.eos_token_ids:
                kept = kept[: i + 1]
                finish[row] = "eos"
                break
        outputs[row].extend(kept)
        if finish[row] == "eos" or len(outputs[row]) >= max_new_tokens:
            active[row] = False
        if stream is not None and kept:
            stream(row, kept)
        return len(kept)
