"""A draft model as draft source: KV cached across steps, one tree-masked forward per level."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from specdec.errors import SpecDecError
from specdec.models.runner import ModelRunner
from specdec.models.vocab import VocabFit, fit_draft_inputs, fit_draft_logits
from specdec.multimodal.inputs import MultimodalPrompt, batch_model_inputs, is_multimodal
from specdec.multimodal.views import PromptView, encode_batch
from specdec.sampling import SamplingParams, logits_to_logprobs

if TYPE_CHECKING:
    from specdec.drafting.builder import TreeBuilder
    from specdec.stats import StepRecord


class ModelDraftSource:
    """Draft distributions from one causal LM sharing the target's tokenizer.

    The draft cache holds every committed token except the ones still "pending": tokens
    accepted at the end of a path that the draft never forwarded (a leaf). The next step
    forwards the pending tokens and the new root together, so nothing is re-prefilled.
    Tree nodes are forwarded level by level; a node sees the committed prefix, the
    step's pending+root slots, and its ancestors' slots, never its siblings'.
    """

    needs_target_logprobs = False

    def __init__(self, model: PreTrainedModel, view: PromptView | None = None, vocab: VocabFit | None = None) -> None:
        """view: how the draft sees a prompt (e.g. text only, for a text-only draft of a
        vision-language target); None = the target's own token ids and image inputs.
        vocab: brings the draft's logits to the target's width (`specdec.models.vocab`); None = same width."""
        self.runner = ModelRunner(model)
        self.vocab = vocab
        self.view = view
        self.multimodal = is_multimodal(model)
        self.pending: list[list[int]] = []
        # per step: builder node -> step slot, and each forwarded node's visible step slots
        self._node_slot = torch.zeros(0, 0, dtype=torch.long)  # [B, N_alloc], -1 = not forwarded
        self._node_vis = torch.zeros(0, 0, 0, dtype=torch.bool)  # [B, N_alloc, S_step]
        self._root_pos = torch.zeros(0, dtype=torch.long)  # [B] position id of the root

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts: Sequence[Sequence[int]] | None = None
    ) -> None:
        model_inputs: dict[str, Any] = {}
        if prompts is not None and self.view is not None:
            input_ids, attention_mask, model_inputs = encode_batch(self.view, prompts, self.runner.device, self.runner.model)
        elif prompts is not None and any(isinstance(p, MultimodalPrompt) and p.model_inputs for p in prompts):
            if not self.multimodal:
                raise SpecDecError("the draft is a text-only model but the prompts have images; give the draft source a view (e.g. TextOnlyView)")
            model_inputs = batch_model_inputs(prompts, self.runner.device)
        input_ids = fit_draft_inputs(input_ids, self.vocab)  # ids beyond a narrower draft's rows
        if rows is None:
            self.runner.prefill(input_ids, attention_mask, model_inputs)
            self.pending = [[] for _ in range(input_ids.shape[0])]
            return
        self.runner.replace_rows(rows, input_ids, attention_mask, model_inputs)
        for row in rows:
            self.pending[row] = []

    def keep_rows(self, rows: list[int]) -> None:
        self.runner.keep_rows(torch.tensor(rows, dtype=torch.long))
        self.pending = [self.pending[r] for r in rows]

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        roots = fit_draft_inputs(roots, self.vocab)  # a target-emitted id the draft has no row for
        dev = self.runner.device
        b = roots.shape[0]
        width = 1 + max(len(p) for p in self.pending)
        # left-pad each row's [pending..., root] to `width`
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)
        valid = torch.zeros(b, width, dtype=torch.bool, device=dev)
        for row, pend in enumerate(self.pending):
            seq = pend + [int(roots[row])]
            ids[row, width - len(seq) :] = torch.tensor(seq, device=dev)
            valid[row, width - len(seq) :] = True
        base = self.runner.committed_len()
        positions = base[:, None] + (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=dev))
        visibility = causal[None] & valid[:, None, :]
        logits = self.runner.forward(ids, positions, visibility)[:, -1]  # [B, V]
        self._root_pos = positions[:, -1]
        self._node_slot = torch.full((b, 1), -1, dtype=torch.long, device=dev)
        self._node_slot[:, 0] = width - 1
        self._node_vis = visibility[:, -1:, :].clone()  # [B, 1, width]: the root sees pending + itself
        return logits_to_logprobs(fit_draft_logits(logits, self.vocab), params)

    def expand(self, builder: TreeBuilder, nodes: torch.Tensor, valid: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        dev = self.runner.device
        b, k = nodes.shape
        s_step = self.runner.step_len
        parents = builder.parents.gather(1, nodes)  # [B, k]
        if bool(((parents < 0) & valid).any()):
            raise ValueError("expand: only non-root nodes can be expanded after begin_step")
        # grow the node maps to cover the builder's nodes
        n_alloc = builder.num_nodes
        if self._node_slot.shape[1] < n_alloc:
            grow = n_alloc - self._node_slot.shape[1]
            self._node_slot = torch.cat([self._node_slot, torch.full((b, grow), -1, dtype=torch.long, device=dev)], dim=1)
            self._node_vis = torch.cat([self._node_vis, torch.zeros(b, grow, self._node_vis.shape[2], dtype=torch.bool, device=dev)], dim=1)
        parent_vis = self._node_vis.gather(1, parents.clamp(min=0)[:, :, None].expand(b, k, s_step))  # [B, k, S_step]
        parent_vis = parent_vis & valid[:, :, None]
        own = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        visibility = torch.cat([parent_vis, own], dim=2)  # [B, k, S_step + k]
        positions = self._root_pos[:, None] + builder.depths.gather(1, nodes)
        logits = self.runner.forward(builder.tokens.gather(1, nodes), positions, visibility)  # [B, k, V]
        # record slots and visibility rows of the forwarded nodes
        self._node_vis = torch.cat([self._node_vis, torch.zeros(b, self._node_vis.shape[1], k, dtype=torch.bool, device=dev)], dim=2)
        slots = torch.arange(s_step, s_step + k, device=dev).expand(b, k)
        self._node_slot.scatter_(1, nodes, torch.where(valid, slots, self._node_slot.gather(1, nodes)))
        rows = torch.arange(b, device=dev)[:, None].expand(b, k)
        self._node_vis[rows[valid], nodes[valid]] = visibility[valid]
        return logits_to_logprobs(fit_draft_logits(logits, self.vocab), params)

    def end_step(self, builder: TreeBuilder, accepted_nodes: list[list[int]], target_logprobs=None) -> None:
        dev = self.runner.device
        b = len(accepted_nodes)
        keep_rows: list[list[int]] = []
        root_vis = self._node_vis[:, 0, :]  # [B, S_step]: pending + root slots of each row
        for row, path in enumerate(accepted_nodes):
            slots = root_vis[row].nonzero().flatten().tolist()
            pending: list[int] = []
            for node in path:
                slot = int(self._node_slot[row, node]) if node < self._node_slot.shape[1] else -1
                if slot >= 0 and not pending:
                    slots.append(slot)
                else:  # accepted but never forwarded by the draft: forwarded next step
                    pending.append(int(builder.tokens[row, node]))
            keep_rows.append(slots)
            self.pending[row] = pending
        width = max(len(s) for s in keep_rows)
        keep = torch.zeros(b, width, dtype=torch.long, device=dev)
        keep_valid = torch.zeros(b, width, dtype=torch.bool, device=dev)
        for row, slots in enumerate(keep_rows):
            keep[row, : len(slots)] = torch.tensor(slots, dtype=torch.long, device=dev)
            keep_valid[row, : len(slots)] = True
        self.runner.commit(keep, keep_valid)

    def feedback(self, record: StepRecord) -> None:
        return None

    @property
    def forward_s(self) -> float:
        """Cumulative wall time inside the draft model's forwards."""
        return self.runner.forward_s
