"""A draft model as draft source: KV cached across steps, one tree-masked forward per level."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from specdec import constants
from specdec.errors import SpecDecError
from specdec.models.runner import ModelRunner
from specdec.models.vocab import VocabFit, fit_draft_inputs, fit_draft_logits
from specdec.multimodal.inputs import MultimodalPrompt, is_multimodal, prefill_inputs
from specdec.multimodal.views import PromptView, encode_batch
from specdec.sampling import SamplingParams, logits_to_logprobs
from specdec.sources.base import AcceptedPaths, NodeBatch

if TYPE_CHECKING:
    from specdec.stats import StepRecord


_SLOT_BLOCK = 64
"""step-slot bookkeeping grows in blocks of this many slots"""

class ModelDraftSource:
    """Draft distributions from one causal LM sharing the target's tokenizer.

    The draft cache holds every committed token except a few "pending" ones per row that
    the draft never forwarded: an accepted leaf, and the roots of steps that drafted nothing
    (`defer`). The next step forwards the pending tokens and the new root together (P + 1
    step slots, pending slots masked out where a row has fewer), so nothing is re-prefilled.
    Tree nodes are forwarded level by level; a node sees the committed prefix, the step's
    pending and root slots, and its ancestors' slots, never its siblings'. Everything stays
    on the device: no host reads.
    """

    max_pending = 128
    """the most tokens a row may owe the draft: `defer` refuses past it (the policy then drafts)"""
    always_proposes = True
    """a model's distributions (after the sampling params) always have mass (`DraftSource.always_proposes`)"""

    def __init__(
        self, model: PreTrainedModel, view: PromptView | None = None, vocab: VocabFit | None = None, static_shapes: bool = False, cuda_graphs: bool = False
    ) -> None:
        """view: how the draft sees a prompt (e.g. text only, for a text-only draft of a
        vision-language target); None = the target's own token ids and image inputs.
        vocab: brings the draft's logits to the target's width (`specdec.models.vocab`); None = same width.
        static_shapes, cuda_graphs: the draft runner's forward mode (`ModelRunner`)."""
        if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
            raise SpecDecError(
                f"the draft source's model must be a loaded causal LM (a transformers PreTrainedModel), got {type(model).__name__}; "
                "load it with AutoModelForCausalLM.from_pretrained(...)"
            )
        if vocab is not None and not isinstance(vocab, VocabFit):
            raise SpecDecError(f"vocab must be a specdec.models.vocab.VocabFit or None, got {type(vocab).__name__}; build it with VocabFit.for_pair(target, draft, len(tokenizer))")
        if view is not None and (isinstance(view, (str, type)) or not callable(getattr(view, "encode", None))):
            shown = f"the class {view.__name__} (pass an instance)" if isinstance(view, type) else repr(view)
            raise SpecDecError(f"view must be a prompt view (specdec.multimodal.views, e.g. TextOnlyView(...)) or None, got {shown}")
        self.runner = ModelRunner(model, static_shapes=static_shapes, cuda_graphs=cuda_graphs)
        self.vocab = vocab
        self.view = view
        self.multimodal = is_multimodal(model)
        dev = self.runner.device
        self.pending_token = torch.zeros(0, 1, dtype=torch.long, device=dev)  # [B, P] oldest first
        self.pending_valid = torch.zeros(0, 1, dtype=torch.bool, device=dev)  # [B, P] (rows owe different counts)
        self._deferred: torch.Tensor | None = None  # [B] the roots of a step that drafted nothing (`defer`)
        # per step slot (0..P-1: pending, P: root, then the forwarded nodes in forward order): the
        # builder node it holds and whether it is visible; preallocated, reused every step
        self._slot_node = torch.zeros(0, 0, dtype=torch.long, device=dev)  # [B, S_cap] (pending and root slots: node 0)
        self._slot_ok = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [B, S_cap]
        self._root_pos = torch.zeros(0, dtype=torch.long, device=dev)  # [B] position id of the root
        self._causal2 = torch.tril(torch.ones(2, 2, dtype=torch.bool, device=dev))
        self._slots_p = 1  # the P the pending and root slots were last laid out for (P = 1: never touched since allocation)

    @property
    def pending(self) -> list[list[int]]:
        """Per row, the pending tokens, oldest first (a host read, for tests and debugging)."""
        return [[t for t, v in zip(tokens, valid, strict=True) if v] for tokens, valid in zip(self.pending_token.tolist(), self.pending_valid.tolist(), strict=True)]

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts: Sequence[Sequence[int]] | None = None
    ) -> None:
        model_inputs: dict[str, Any] | list[dict[str, Any]] = {}
        if prompts is not None and self.view is not None:
            input_ids, attention_mask, model_inputs = encode_batch(self.view, prompts, self.runner.device, self.runner.model)
        elif prompts is not None and any(isinstance(p, MultimodalPrompt) and p.model_inputs for p in prompts):
            if not self.multimodal:
                raise SpecDecError("the draft is a text-only model but the prompts have images; give the draft source a view (e.g. TextOnlyView)")
            model_inputs = prefill_inputs(prompts, self.runner.device, self.runner.model)
        self.prefill_rows(input_ids, attention_mask, rows, model_inputs)

    def prefill_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None, model_inputs: dict[str, Any] | list[dict[str, Any]] | None = None
    ) -> None:
        """Prefill already-encoded prompts: a new batch (rows None) or into batch rows `rows`."""
        dev = self.runner.device
        input_ids = fit_draft_inputs(input_ids, self.vocab)  # ids beyond a narrower draft's rows
        if rows is None:
            self.runner.prefill(input_ids, attention_mask, model_inputs)
            b = input_ids.shape[0]
            self.pending_token = torch.zeros(b, 1, dtype=torch.long, device=dev)
            self.pending_valid = torch.zeros(b, 1, dtype=torch.bool, device=dev)
            self._deferred = None
            return
        self.runner.replace_rows(rows, input_ids, attention_mask, model_inputs)
        index = torch.tensor(rows, dtype=torch.long, device=dev)
        self.pending_valid[index] = False

    def keep_rows(self, rows: list[int], room: int | None = None) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.runner.device)
        self.runner.keep_rows(rows, room=room)  # a host list: hole-filling orders copy only the moved rows
        self.pending_token = self.pending_token[index]
        self.pending_valid = self.pending_valid[index]

    def defer(self, roots: torch.Tensor) -> bool:
        """This step drafts nothing (its tree is the root alone, so `begin_step` is not called):
        the root joins the row's pending tokens at `end_step`, to be forwarded with the next
        drafted step's. Returns False, deferring nothing, when a row could owe more than
        `max_pending` tokens: the policy must draft this step."""
        if self.pending_token.shape[1] >= self.max_pending:
            return False
        self._deferred = roots
        return True

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        b, p = self.pending_token.shape
        self._deferred = None
        if self.runner.level_graphs is not None:  # captured levels: the model's buffers, so levels replay across engines
            self._take_shared_slots(b, p)
        elif self._slot_ok.shape[0] != b or self._slot_ok.shape[1] < p + 1:
            cap = -(-(p + 1) // _SLOT_BLOCK) * _SLOT_BLOCK
            self._slot_node = torch.zeros(b, cap, dtype=torch.long, device=self.runner.device)
            self._slot_ok = torch.ones(b, cap, dtype=torch.bool, device=self.runner.device)
            self._slots_p = 1
        if p != self._slots_p:  # after plain steps: slots 0..p were node slots or pending ones of another layout
            self._slot_node[:, : p + 1] = 0  # the pending and root slots hold no builder node but the root
            self._slot_ok[:, p] = True  # the root is always visible
            self._slots_p = p
        self._slot_ok[:, :p] = self.pending_valid
        ids = fit_draft_inputs(torch.cat([self.pending_token, roots[:, None]], dim=1), self.vocab)  # [B, P + 1]: pending (maybe masked), root; target-emitted ids the draft has no row for -> 0
        base = self.runner.committed_len()  # [B]
        if p == 1:  # the usual step: at most an accepted leaf is owed
            positions = torch.stack([base, base + self.pending_valid[:, 0]], dim=1)  # [B, 2]
            causal = self._causal2
        else:
            owed = self.pending_valid.long().cumsum(dim=1)  # [B, P] valid pending tokens up to each slot
            positions = base[:, None] + torch.nn.functional.pad(owed, (1, 0))  # [B, P + 1]: each slot after the valid ones before it
            causal = torch.tril(torch.ones(p + 1, p + 1, dtype=torch.bool, device=roots.device))
        visibility = causal & self._slot_ok[:, None, : p + 1]  # [B, P + 1, P + 1]
        # a catch-up after plain steps (P > 1) has a one-off width: run eagerly rather than capture
        # a CUDA graph for it mid-decode (the usual P = 1 forward is captured once and replayed).
        # Only the root's logits are read: the LM head runs on its position alone (a small draft's
        # head can cost more than its layers: the bundled draft's is 57% of a token's multiply-adds),
        # except for the captured P = 1 forward, whose static shape keeps both positions
        keep_root_only = p > 1 or not self.runner.static_shapes
        logits = self.runner.forward(ids, positions, visibility, logits_to_keep=1 if keep_root_only else 0, capture=p == 1)[:, -1]  # [B, V]
        if self.runner.level_graphs is None:
            self._root_pos = positions[:, p]  # a view: no op
        else:  # captured levels read it at one address every step, whichever source of the model drafts
            root_pos = self.runner.level_buffers.get(("draft_root_pos", b))
            if root_pos is None:
                root_pos = self.runner.level_buffers[("draft_root_pos", b)] = torch.empty(b, dtype=torch.long, device=roots.device)
            self._root_pos = root_pos.copy_(positions[:, p])
        return logits_to_logprobs(fit_draft_logits(logits, self.vocab), params)

    def reserve_step_slots(self, slots: int) -> tuple[int, ...]:
        """Room for `slots` step slots in the slot bookkeeping (grows it, rarely), so that no
        forward of the step reallocates it; returns the addresses a captured level reads here."""
        self._grow_slots(slots)
        return (self._slot_node.data_ptr(), self._slot_ok.data_ptr(), self._root_pos.data_ptr())

    def hide_step_slots(self, start: int, count: int) -> None:
        """Mark step slots start..start + count - 1 as holding no visible node (one op), before a
        step whose levels leave some of them unwritten (`CapturedLevels.place`): what an earlier
        step wrote there must not be seen, nor matched at commit. Reserved (`reserve_step_slots`)."""
        self._slot_ok[:, start : start + count] = False

    def _grow_slots(self, slots: int) -> None:
        if slots > self._slot_ok.shape[1]:  # more step slots than ever before (rare): grow
            b = self._slot_ok.shape[0]
            grow = -(-(slots - self._slot_ok.shape[1]) // _SLOT_BLOCK) * _SLOT_BLOCK
            self._slot_node = torch.cat([self._slot_node, self._slot_node.new_zeros(b, grow)], dim=1)
            self._slot_ok = torch.cat([self._slot_ok, self._slot_ok.new_zeros(b, grow)], dim=1)
            if self.runner.level_graphs is not None:
                self.runner.level_buffers[("draft_slot_node", b)], self.runner.level_buffers[("draft_slot_ok", b)] = self._slot_node, self._slot_ok

    def _take_shared_slots(self, b: int, p: int) -> None:
        """The draft model's slot bookkeeping for B rows (shared by its sources, so captured
        levels read one address whichever engine drafts), laid out afresh when another source
        used it last or it is new."""
        buffers, dev = self.runner.level_buffers, self.runner.device
        node, ok = buffers.get(("draft_slot_node", b)), buffers.get(("draft_slot_ok", b))
        if node is None or ok is None or ok.shape[1] < p + 1:
            cap = -(-(p + 1) // _SLOT_BLOCK) * _SLOT_BLOCK
            node = buffers[("draft_slot_node", b)] = torch.zeros(b, cap, dtype=torch.long, device=dev)
            ok = buffers[("draft_slot_ok", b)] = torch.zeros(b, cap, dtype=torch.bool, device=dev)
        owner = ("draft_slots", b)
        if node is not self._slot_node or ok is not self._slot_ok or self.runner.level_owner.get(owner) != id(self):
            self._slot_node, self._slot_ok = node, ok
            self._slots_p = -1  # the pending and root slots are laid out below
            self.runner.level_owner[owner] = id(self)

    def expand(self, batch: NodeBatch, params: SamplingParams) -> torch.Tensor:
        nodes, valid = batch.nodes, batch.valid
        b, k = nodes.shape
        n_alloc = batch.tokens.shape[1]
        s_step = self.runner.step_len
        self._grow_slots(s_step + k)
        # a node sees the step slots that hold its ancestors (the pending and root slots for every
        # node); an invalid entry's row is never used (its slot stays invisible to everyone)
        if batch.chain:  # the newest node of a chain: its ancestors are every slot so far
            seen = self._slot_ok[:, None, :s_step]  # [B, 1, S_step]
            ids = batch.tokens[:, -1:]  # [B, 1] (= nodes' tokens)
        else:
            anc_rows = batch.ancestors.gather(1, nodes[:, :, None].expand(b, k, n_alloc))  # [B, k, N]
            seen = anc_rows.gather(2, self._slot_node[:, None, :s_step].expand(b, k, s_step)).logical_and_(self._slot_ok[:, None, :s_step])  # [B, k, S_step]
            ids = batch.tokens.gather(1, nodes)  # [B, k]
        if batch.depth is None:
            positions = batch.depths.gather(1, nodes).add_(self._root_pos[:, None])  # [B, k]
        else:
            positions = (self._root_pos + batch.depth)[:, None].expand(b, k)
        logits = self.runner.forward(ids, positions, seen)  # [B, k, V]; the runner adds each node's own slot
        self._slot_node[:, s_step : s_step + k] = nodes
        self._slot_ok[:, s_step : s_step + k] = valid
        return logits_to_logprobs(fit_draft_logits(logits, self.vocab), params)

    def end_step(self, accepted: AcceptedPaths) -> None:
        """Keep the pending and root slots and the accepted nodes the draft forwarded; an
        accepted leaf it never forwarded becomes the row's pending token. After a deferred
        step (nothing drafted, nothing accepted) the root is pending too."""
        if self._deferred is not None:
            roots, self._deferred = self._deferred, None
            self.pending_token = torch.cat([self.pending_token, roots[:, None]], dim=1)
            self.pending_valid = torch.nn.functional.pad(self.pending_valid, (0, 1), value=True)
            return
        path, length = accepted.nodes, accepted.length  # [B, D], [B]
        b, d = path.shape
        p = self.pending_token.shape[1]
        s_step = self.runner.step_len
        if accepted.chain:  # nodes 1..f sit in slots p + 1.., in order: the accepted ones already lead the step
            f = s_step - (p + 1)  # chain nodes forwarded (every one but the last)
            forwarded = constants.arange(f, path.device)[None, :] < length[:, None]  # [B, f]: node j + 1 accepted
            keep_valid = torch.cat([self._slot_ok[:, : p + 1], forwarded], dim=1)  # [B, S_step]
            self.pending_valid = (length > f)[:, None]  # [B, 1]: the last node, accepted but never forwarded
            leaf = min(f + 1, accepted.tokens.shape[1] - 1)
            self.pending_token = accepted.tokens[:, leaf : leaf + 1]  # [B, 1], only read when pending
            self.runner.commit(constants.arange(s_step, path.device).expand(b, s_step), keep_valid, in_place=True)
            return
        on_path = constants.arange(d, path.device)[None, :] < length[:, None]  # [B, D]
        # the step slot that holds each path node, if the draft forwarded it
        hit = (path[:, :, None] == self._slot_node[:, None, :s_step]).logical_and_(self._slot_ok[:, None, :s_step])  # [B, D, S_step]
        forwarded, path_slots = hit.max(dim=2)  # [B, D] each: at most one slot per node
        forwarded.logical_and_(on_path)  # padding entries (node 0) match the pending and root slots
        keep = torch.cat([constants.arange(p + 1, path.device).expand(b, p + 1), path_slots], dim=1)  # [B, P + 1 + D]
        keep_valid = torch.cat([self._slot_ok[:, : p + 1], forwarded], dim=1)
        last = (length - 1).clamp_(min=0)[:, None]  # [B, 1] the deepest accepted node's column
        self.pending_valid = on_path.logical_and_(~forwarded).gather(1, last)  # [B, 1]: accepted but never forwarded
        self.pending_token = accepted.tokens.gather(1, path.gather(1, last))  # [B, 1], only read when pending
        self.runner.commit(keep, keep_valid)

    def feedback(self, record: StepRecord) -> None:
        return None

    @property
    def forward_s(self) -> float:
        """Cumulative wall time inside the draft model's forwards."""
        return self.runner.forward_s
