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
from specdec.multimodal.inputs import MultimodalPrompt, batch_model_inputs, is_multimodal
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
        self.multimodal = is_multimodal(target)

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
            if isinstance(prompt, MultimodalPrompt) and prompt.model_inputs and not self.multimodal:
                raise SpecDecError(
                    f"prompt {i} has {len(prompt.images)} image(s) but the target is a text-only model; "
                    "use a vision-language (LLaVA-family) target or drop the images"
                )
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
        batch_size: int | None = None,
    ) -> list[EngineOutput]:
        """Decode every prompt (token ids, or a `MultimodalPrompt` for a LLaVA-family target);
        returns one output per prompt, in order.

        Up to `batch_size` prompts (default: all) are decoded together as rows of one batch.
        A row that finishes retires; while prompts wait, the next one is prefilled into the
        free row at the next step boundary. `stream(prompt_index, tokens)` gets each
        prompt's newly committed tokens.
        """
        params = params or SamplingParams()
        self._validate(prompts, max_new_tokens)
        batch_size = len(prompts) if batch_size is None else batch_size
        if not isinstance(batch_size, int) or batch_size < 1:
            raise SpecDecError(f"batch_size={batch_size!r} must be a positive integer")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        elif not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.seed()
        run = _Run(prompts, max_new_tokens, stream, self.eos_token_ids)
        forward_s0 = self._forward_s()
        t_start = time.perf_counter()

        queue = list(range(len(prompts)))
        rows: list[int] = queue[:batch_size]  # prompt index held by each batch row
        del queue[:batch_size]
        ids, mask = self._left_pad([prompts[i] for i in rows])
        roots = self._admit(rows, ids, mask, None, params, generator, run, t_start)
        rows, roots = self._retire_and_admit(rows, roots, queue, params, generator, run, t_start)

        records: list[StepRecord] = []
        step = 0
        while rows:
            active = torch.tensor([not run.done[i] for i in rows], dtype=torch.bool)
            remaining = max(max_new_tokens - len(run.outputs[i]) for i in rows if not run.done[i])
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
                self.source.end_step(builder, [origin[r, path].tolist() if path else [] for r, path in enumerate(verdict.accepted_nodes)])
            was_active = active.tolist()
            committed = [0] * len(rows)
            for r, prompt_index in enumerate(rows):
                if was_active[r]:
                    new = tree.tokens[r, verdict.accepted_nodes[r]].tolist() + [int(verdict.bonus_tokens[r])]
                    committed[r] = run.append(prompt_index, new)
            record = StepRecord(
                step=step,
                active=was_active,
                drafted=[d if a else 0 for d, a in zip(tree.drafted_per_row().tolist(), was_active, strict=True)],
                accepted_len=[len(p) if a else 0 for p, a in zip(verdict.accepted_nodes, was_active, strict=True)],
                committed=committed,
                relaxed=verdict.relaxed,
                strict_fallbacks=verdict.strict_fallbacks,
                tree_depth=tree.max_depth(),
                draft_s=t1 - t0,
                verify_s=t2 - t1,
                drafted_by_depth=self._drafted_by_depth(tree),
                accepted_depth=[len(p) for p in verdict.accepted_nodes],
                prompt_index=list(rows),
            )
            for r, prompt_index in enumerate(rows):
                if was_active[r]:
                    stats = run.stats[prompt_index]
                    stats.add_step(record, r)
                    stats.draft_s += record.draft_s
                    stats.verify_s += record.verify_s
            if keep_steps:
                records.append(record)
            self.policy.feedback(record)
            if self.source is not None:
                self.source.feedback(record)
            roots = verdict.bonus_tokens.to(self.device)
            step += 1
            rows, roots = self._retire_and_admit(rows, roots, queue, params, generator, run, t_start)

        forward_s = self._forward_s() - forward_s0
        results = []
        for i in range(len(prompts)):
            stats = run.stats[i]
            stats.new_tokens = len(run.outputs[i])
            stats.forward_s = forward_s
            results.append(EngineOutput(token_ids=run.outputs[i], finish_reason=run.finish[i], stats=stats, steps=records))
        return results

    def _forward_s(self) -> float:
        return self.target.forward_s + (self.source.forward_s if self.source is not None else 0.0)

    def _admit(self, rows, ids, mask, batch_rows, params, generator, run, t_start) -> torch.Tensor:
        """Prefill prompts `rows` (into batch rows `batch_rows`, or as a new batch when None);
        choose and append their first tokens; return those tokens [len(rows)]."""
        t0 = time.perf_counter()
        # target_logits: [B', V], the distribution of each admitted prompt's first new token
        prompts = [run.prompts[i] for i in rows]
        model_inputs = batch_model_inputs(prompts, self.device)  # pixel values of multimodal prompts
        if batch_rows is None:
            target_logits = self.target.prefill(ids, mask, model_inputs)
        else:
            target_logits = self.target.replace_rows(batch_rows, ids, mask, model_inputs)
        if self.source is not None:
            self.source.prefill(ids, mask, batch_rows, prompts=prompts)
        first = choose_tokens(target_logits, params, generator)  # [B']
        t1 = time.perf_counter()
        for r, prompt_index in enumerate(rows):
            stats = run.stats[prompt_index]
            stats.queue_s = t0 - t_start
            stats.prefill_s = stats.ttft_s = t1 - t0
            run.started[prompt_index] = t0
            run.append(prompt_index, [int(first[r])])
        return first

    def _retire_and_admit(self, rows, roots, queue, params, generator, run, t_start):
        """Between steps: finished rows take the next waiting prompts, or leave the batch.

        A prompt can finish at its first token (EOS, or max_new_tokens=1), so admission
        repeats until every row is live or nothing waits."""
        while admit_into := [r for r, i in enumerate(rows) if run.done[i]][: len(queue)]:
            incoming = queue[: len(admit_into)]
            del queue[: len(admit_into)]
            ids, mask = self._left_pad([run.prompts[i] for i in incoming])
            first = self._admit(incoming, ids, mask, admit_into, params, generator, run, t_start)
            roots = roots.clone()
            for r, prompt_index, tok in zip(admit_into, incoming, first.tolist(), strict=True):
                rows[r] = prompt_index
                roots[r] = tok
        keep = [r for r, i in enumerate(rows) if not run.done[i]]
        if len(keep) < len(rows):
            if keep:
                self.target.keep_rows(torch.tensor(keep, dtype=torch.long))
                if self.source is not None:
                    self.source.keep_rows(keep)
            rows = [rows[r] for r in keep]
            roots = roots[torch.tensor(keep, dtype=torch.long, device=roots.device)] if keep else roots[:0]
        return rows, roots

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


class _Run:
    """Per-prompt outputs and stops of one `generate` call."""

    def __init__(self, prompts, max_new_tokens: int, stream: StreamCallback | None, eos_token_ids: set[int]) -> None:
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.stream = stream
        self.eos_token_ids = eos_token_ids
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.finish = ["length"] * len(prompts)
        self.done = [False] * len(prompts)
        self.started = [0.0] * len(prompts)
        self.stats = [GenerationStats(prompt_tokens=len(p)) for p in prompts]

    def append(self, index: int, new: list[int]) -> int:
        """Append `new` to a prompt's output, cutting at EOS and at the budget; returns the
        number kept. Marks the prompt done (and its wall time) when it stops."""
        room = self.max_new_tokens - len(self.outputs[index])
        kept = new[:room]
        for i, tok in enumerate(kept):
            if tok in self.eos_token_ids:
                kept = kept[: i + 1]
                self.finish[index] = "eos"
                break
        self.outputs[index].extend(kept)
        if self.finish[index] == "eos" or len(self.outputs[index]) >= self.max_new_tokens:
            self.done[index] = True
            self.stats[index].wall_s = time.perf_counter() - self.started[index]
        if self.stream is not None and kept:
            self.stream(index, kept)
        return len(kept)
