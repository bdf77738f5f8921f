"""ModelRunner: one causal LM, its KV cache, and commit/rollback of cache slots.

The cache holds `S` slots per row. `slot_valid[b, s]` says whether slot `s` of row `b`
holds a committed token (padding and holes left by rows that accepted fewer tokens are
invalid and masked out). A token's position id is the number of valid slots before it,
so holes never shift positions.

A decoding step appends "step slots" with `forward` (any number of calls: the draft
adds one tree level per call), then `commit` keeps a chosen subset of them, gathered to
the end of the committed prefix, and drops the rest; `rollback` drops them all. Only
the public `transformers` API is used: `DynamicCache`, a 4D additive attention mask and
explicit `position_ids`, so any decoder-only architecture with a standard cache works.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.errors import SpecDecError


class ModelRunner:
    """Runs one model over a batch of rows with a KV cache it can commit and roll back."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: DynamicCache | None = None
        self.slot_valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S_past]
        self.step_len = 0  # step slots appended since the last commit/rollback
        self.forward_calls = 0
        self.forward_tokens = 0
        self.forward_s = 0.0  # wall time inside model forwards (synchronised on CUDA)

    # ----- state -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.slot_valid.shape[0]

    @property
    def past_len(self) -> int:
        """S_past: committed slots per row (valid or not)."""
        return self.slot_valid.shape[1]

    def committed_len(self) -> torch.Tensor:
        """[B] number of committed tokens per row = position id of the next token."""
        return self.slot_valid.sum(dim=1)

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.slot_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.step_len = 0

    # ----- forwards ----------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step_visibility: torch.Tensor,
        logits_to_keep: int = 0,
        model_inputs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Append `n` step slots and return their logits.

        input_ids:       [B, n] int64
        position_ids:    [B, n] int64
        step_visibility: [B, n, step_len + n] bool: which step slots (earlier ones of this
                         step, then the n new ones) each new token attends to. Every new
                         token also attends to all valid committed slots and to itself.
        model_inputs:    extra model inputs for this forward (prefill of a multimodal
                         prompt: pixel_values and the like).
        Returns logits [B, n, V] float32 (or [B, logits_to_keep, V]).
        """
        if self.cache is None:
            raise RuntimeError("ModelRunner.forward before reset()")
        b, n = input_ids.shape
        s_past, s_step = self.past_len, self.step_len
        if step_visibility.shape != (b, n, s_step + n):
            raise ValueError(f"step_visibility shape {tuple(step_visibility.shape)} != {(b, n, s_step + n)}")
        diag = torch.arange(n, device=self.device)
        step_visibility = step_visibility.clone()
        step_visibility[:, diag, s_step + diag] = True
        visible = torch.cat([self.slot_valid[:, None, :].expand(b, n, s_past), step_visibility], dim=2)  # [B, n, S]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        t0 = time.perf_counter()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask[:, None, :, :],  # [B, 1, n, S]
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **(model_inputs or {}),
        )
        logits = out.logits.float()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_s += time.perf_counter() - t0
        self.step_len += n
        self.forward_calls += 1
        self.forward_tokens += b * n
        return logits

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any] | None = None) -> torch.Tensor:
        """Run left-padded prompts and commit them; return the logits of the last position.

        input_ids: [B, L] int64 (left-padded); attention_mask: [B, L] (1 = real token);
        model_inputs: the batch's other inputs (pixel_values of its images, in row order).
        Returns [B, V] float32: the distribution of each row's first new token.
        """
        self.reset(input_ids.shape[0])
        real = attention_mask.bool()
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool, device=self.device))
        visibility = causal[None] & real[:, None, :]  # [B, L, L]
        logits = self.forward(input_ids, positions, visibility, logits_to_keep=1, model_inputs=model_inputs)[:, -1]
        keep = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)
        self.commit(keep, real)
        return logits

    # ----- commit / rollback -------------------------------------------------------
    @torch.inference_mode()
    def commit(self, keep: torch.Tensor, keep_valid: torch.Tensor) -> None:
        """Keep step slots `keep` (in order) after the committed prefix; drop the others.

        keep:       [B, K] int64 step-slot indices (0 = first slot appended this step)
        keep_valid: [B, K] bool; False entries are padding and become invalid slots.
        Example: step slots [r, a, b, c] with keep [[0, 1, 3]] -> the cache ends in r, a, c.
        """
        if self.cache is None:
            raise RuntimeError("ModelRunner.commit before reset()")
        s_past, k = self.past_len, keep.shape[1]
        if k > 0:
            src = (s_past + keep.clamp(0, max(self.step_len - 1, 0))).to(self.device)  # [B, K]
            identity = bool(torch.equal(src, torch.arange(s_past, s_past + k, device=self.device).expand_as(src)))
            for layer in self.cache.layers:
                if getattr(layer, "is_sliding", False):
                    raise SpecDecError("sliding-window attention layers are not supported; load the model with sliding windows disabled")
                if not identity:
                    idx = src[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                    kept_keys = layer.keys.gather(2, idx)
                    kept_values = layer.values.gather(2, idx)
                    layer.keys[:, :, s_past : s_past + k] = kept_keys
                    layer.values[:, :, s_past : s_past + k] = kept_values
                layer.keys = layer.keys[:, :, : s_past + k]
                layer.values = layer.values[:, :, : s_past + k]
        else:
            self._crop_to(s_past)
        self.slot_valid = torch.cat([self.slot_valid, keep_valid.to(self.device).bool()], dim=1)
        self.step_len = 0
        self.compact_if_wasteful()

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Shrink the batch to `rows` ([B'] int64 row indices, in their new order)."""
        if self.cache is None or self.step_len:
            raise RuntimeError("keep_rows needs a committed cache (call it between steps)")
        rows = rows.to(self.device)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
        self.slot_valid = self.slot_valid.index_select(0, rows)
        self.compact_if_wasteful()

    @torch.inference_mode()
    def replace_rows(
        self, rows: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any] | None = None
    ) -> torch.Tensor:
        """Prefill new prompts into batch rows `rows` (their old contents are dropped).

        input_ids, attention_mask: [len(rows), L] left-padded. The new rows are prefilled on
        their own and their cache spliced in right-aligned; the cache grows on the left (with
        invalid slots) when L exceeds its width. Returns the new rows' last logits [len(rows), V].
        """
        if self.cache is None or self.step_len:
            raise RuntimeError("replace_rows needs a committed cache (call it between steps)")
        fresh = ModelRunner(self.model)
        logits = fresh.prefill(input_ids, attention_mask, model_inputs)
        assert fresh.cache is not None
        s_new = fresh.past_len
        if s_new > self.past_len:
            self._left_pad(s_new - self.past_len)
        s = self.past_len
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer, new in zip(self.cache.layers, fresh.cache.layers, strict=True):
            layer.keys[index] = 0
            layer.values[index] = 0
            layer.keys[index, :, s - s_new :] = new.keys
            layer.values[index, :, s - s_new :] = new.values
        valid = torch.zeros(len(rows), s, dtype=torch.bool, device=self.device)
        valid[:, s - s_new :] = fresh.slot_valid
        self.slot_valid[index] = valid
        self.compact_if_wasteful()
        return logits

    def _left_pad(self, extra: int) -> None:
        assert self.cache is not None
        for layer in self.cache.layers:
            if layer.is_initialized:
                b, h, _, d = layer.keys.shape
                pad = torch.zeros(b, h, extra, d, dtype=layer.keys.dtype, device=self.device)
                layer.keys = torch.cat([pad, layer.keys], dim=2)
                layer.values = torch.cat([pad.clone(), layer.values], dim=2)
        pad_valid = torch.zeros(self.batch_size, extra, dtype=torch.bool, device=self.device)
        self.slot_valid = torch.cat([pad_valid, self.slot_valid], dim=1)

    def rollback(self) -> None:
        """Drop every step slot appended since the last commit."""
        self._crop_to(self.past_len)
        self.step_len = 0

    def _crop_to(self, length: int) -> None:
        assert self.cache is not None
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.shape[2] > length:
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]

    @torch.inference_mode()
    def compact_if_wasteful(self, max_waste: float = 0.25, min_slots: int = 64) -> None:
        """Remove invalid slots when they exceed `max_waste` of the cache (batches only).

        Rows keep their valid slots in order, right-aligned after left padding, so
        position ids (counts of valid slots) are unchanged.
        """
        if self.cache is None or self.step_len:
            return
        b, s = self.slot_valid.shape
        counts = self.slot_valid.sum(dim=1)
        width = int(counts.max().item()) if b else 0
        if s - width < max(min_slots, max_waste * s):
            return
        # per row: the indices of valid slots, left-padded to `width`
        order = torch.argsort(self.slot_valid.to(torch.int8), dim=1, stable=True)[:, s - width :]  # invalid first, then valid in order
        new_valid = self.slot_valid.gather(1, order)
        for layer in self.cache.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.slot_valid = new_valid
