"""The decode loop: prefill -> (draft -> verify -> commit -> adapt)* until EOS or the token budget.

One loop serves every method: the tree policy decides the shape, the draft source gives
draft distributions, the accept rule picks the path. Plain autoregressive decoding is the
policy that drafts nothing (each step verifies only the root). Rows of a batch are decoded
together; each keeps its own tree, acceptance and stopping point.

The loop runs step by step in a `DecodeSession` (a rolling batch: prompts are submitted at
any time, join free rows at a step boundary and leave when they finish or are cancelled);
`SpeculativeEngine.generate` submits a fixed list of prompts and steps until all are done.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdec import constants
from specdec.drafting.base import TreePolicy
from specdec.drafting.builder import DraftContext, root_only_draft
from specdec.errors import SpecDecError
from specdec.hostwork import uncounted
from specdec.models.loading import context_length, embedding_rows
from specdec.models.runner import ModelRunner, hole_filling_order
from specdec.models.static import WARM_UP_TOKENS
from specdec.models.support import image_prompt_problem
from specdec.models.vocab import output_width
from specdec.multimodal.inputs import MultimodalPrompt, is_multimodal, prefill_inputs
from specdec.parsing import check_callback, check_max_draft_rows, check_seed
from specdec.sampling import SamplingParams, choose_tokens
from specdec.sources.base import DraftSource, TargetPath, keep_source_rows
from specdec.sources.lookup import LookupDraftSource
from specdec.sources.model import ModelDraftSource
from specdec.stats import GenerationStats, StepRecord
from specdec.tree import TokenTree
from specdec.verification.base import AcceptRule, Verdict
from specdec.verification.captured import CapturedWalks
from specdec.verification.mars import MarsRule
from specdec.verification.sampling import SamplingRule

StreamCallback = Callable[[int, list[int]], None]
"""stream(row, new_token_ids) is called with every row's newly committed tokens."""
StopCallback = Callable[[int, list[int]], bool]
"""stop(row, new_token_ids) -> True ends that row now (finish_reason 'stop')."""


@dataclass
class EngineOutput:
    """One row's result."""

    token_ids: list[int]
    """generated tokens only (prompt excluded), EOS included when it ended the sequence"""
    finish_reason: str
    """'eos', 'length', or 'stop' (ended by `SpeculativeEngine.generate`'s `stop` callback)"""
    stats: GenerationStats
    steps: list[StepRecord] = field(default_factory=list)


@dataclass(eq=False)
class DecodeRequest:
    """One prompt submitted to a `DecodeSession`; its output grows as steps commit tokens."""

    index: int
    """submission order within the session (`StepRecord.prompt_index` of its row)"""
    prompt: Sequence[int]
    """token ids, or a `MultimodalPrompt`"""
    max_new_tokens: int
    on_tokens: TokenCallback | None = None
    """called in the stepping thread with (request, newly committed token ids)"""
    seed: int | None = None
    """reseeds the session's generator when the request starts a fresh batch (see `DecodeSession.submit`)"""
    token_ids: list[int] = field(default_factory=list)
    """generated tokens so far (prompt excluded), EOS included when it ended the sequence"""
    finish_reason: str | None = None
    """None while waiting or running; then 'eos', 'length' or the reason given to `DecodeSession.cancel`"""
    stats: GenerationStats = field(default_factory=GenerationStats)
    submitted_at: float = 0.0
    admitted_at: float | None = None
    """when its prefill began (None while it waits for a row)"""
    forward_s_at_admission: float | None = 0.0
    finished_step: int | None = None
    """the session's step count when the request finished (a row that rides along grows from there)"""
    draft_prefill_owed: bool = False
    """admitted while its batch ran more rows than `max_draft_rows`: its prompt was not prefilled into
    the draft model then (steps that large draft nothing), but before the first step that drafts"""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def running(self) -> bool:
        """Holds a batch row and has not finished."""
        return self.admitted_at is not None and not self.done


TokenCallback = Callable[[DecodeRequest, list[int]], None]
"""on_tokens(request, new_token_ids): a request's newly committed tokens (after EOS/budget cuts)"""


@dataclass
class StepResult:
    """A step's verdict on the host, read from the device in one transfer. Lists are per row."""

    accepted_nodes: list[list[int]]
    """tree node indices of the accepted path (root excluded)"""
    accepted_tokens: list[list[int]]
    bonus: list[int]
    relaxed: list[int]
    fallbacks: list[int]
    drafted: list[int]
    """drafted tokens (valid non-root nodes) per row"""
    drafted_by_depth: list[list[int]]
    """drafted nodes at depth 1, 2, ... per row"""
    tree_depth: int
    """depth of the deepest valid node of the batch"""
    tree_parents: list[list[int]]
    """per row: each verified node's parent, -1 for the root and padding"""

    @classmethod
    def read(cls, tree: TokenTree, verdict: Verdict) -> StepResult:
        """Pack everything the host needs into one int64 tensor and read it once (one sync on a GPU)."""
        path = verdict.path  # [B, D]
        d = path.shape[1]
        packed = torch.cat(
            [
                torch.stack([verdict.accepted_len, verdict.bonus_tokens, verdict.relaxed_count, verdict.fallback_count], dim=1),
                path,
                tree.tokens.gather(1, path),  # [B, D]
                tree.depths * tree.valid,  # [B, N]: each valid node's depth, 0 for the root and padding
                tree.parents,  # [B, N]: kept on the host where the depth above is > 0 (no op for a mask)
            ],
            dim=1,
        ).tolist()
        n_nodes = tree.tokens.shape[1]
        accepted_nodes, accepted_tokens, drafted_by_depth, tree_parents = [], [], [], []
        for row in packed:
            n = row[0]
            accepted_nodes.append(row[4 : 4 + n])
            accepted_tokens.append(row[4 + d : 4 + d + n])
            node_depths = row[4 + 2 * d : 4 + 2 * d + n_nodes]
            tree_parents.append([p if depth > 0 else -1 for p, depth in zip(row[4 + 2 * d + n_nodes :], node_depths, strict=True)])
            depths = [x for x in node_depths if x > 0]
            counts = [0] * max(depths, default=0)
            for depth in depths:
                counts[depth - 1] += 1
            drafted_by_depth.append(counts)
        deepest = max(len(counts) for counts in drafted_by_depth)
        return cls(
            accepted_nodes=accepted_nodes,
            accepted_tokens=accepted_tokens,
            bonus=[row[1] for row in packed],
            relaxed=[row[2] for row in packed],
            fallbacks=[row[3] for row in packed],
            drafted=[sum(counts) for counts in drafted_by_depth],
            drafted_by_depth=[counts + [0] * (deepest - len(counts)) for counts in drafted_by_depth],
            tree_depth=deepest,
            tree_parents=tree_parents,
        )


def _check_parts(target: object, policy: object, rule: object, source: object) -> None:
    """A SpecDecError naming the argument when the engine's parts are not what it runs (a method
    name for a policy, a class for an instance, a bare draft model for a draft source), instead
    of an AttributeError at the first step."""
    if not isinstance(target, torch.nn.Module) or getattr(target, "config", None) is None:
        raise SpecDecError(
            f"target must be a loaded causal LM (a transformers PreTrainedModel), got {type(target).__name__}; "
            "load it with AutoModelForCausalLM.from_pretrained(...), or use SpeculativeDecoder.from_pretrained(path)"
        )
    if isinstance(policy, str):
        raise SpecDecError(f"policy={policy!r} is a method name; pass a policy: specdec.methods.make_policy({policy!r}, **options)")
    if isinstance(policy, type) or not callable(getattr(policy, "draft", None)) or not hasattr(policy, "uses_draft"):
        shown = f"the class {policy.__name__} (pass an instance)" if isinstance(policy, type) else type(policy).__name__
        raise SpecDecError(f"policy must be a tree policy, got {shown}; build one with specdec.methods.make_policy(name, **options)")
    if isinstance(rule, str):
        raise SpecDecError(f"rule={rule!r} is an accept rule's name; pass a rule: specdec.verification.make_rule({rule!r})")
    if isinstance(rule, type) or not callable(getattr(rule, "verify", None)):
        shown = f"the class {rule.__name__} (pass an instance)" if isinstance(rule, type) else type(rule).__name__
        raise SpecDecError(f"rule must be an accept rule, got {shown}; build one with specdec.verification.make_rule('greedy', 'sampling' or 'mars')")
    if isinstance(source, torch.nn.Module):
        raise SpecDecError(
            f"source is a model ({type(source).__name__}), not a draft source; wrap it: specdec.sources.ModelDraftSource(draft) "
            "(with vocab=VocabFit.for_pair(target, draft, len(tokenizer)) when their output layers differ in width)"
        )
    if source is not None and (isinstance(source, type) or not callable(getattr(source, "begin_step", None)) or not callable(getattr(source, "prefill", None))):
        shown = f"the class {source.__name__} (pass an instance)" if isinstance(source, type) else type(source).__name__
        raise SpecDecError(f"source must be a draft source (specdec.sources.ModelDraftSource(draft), LookupDraftSource, ...) or None, got {shown}")


def _check_source_width(target: PreTrainedModel, source: DraftSource | None) -> None:
    """A SpecDecError when the draft source's distributions would not be as wide as the target's
    logits (a draft whose output layer differs in width, given no `VocabFit`; a lookup source
    sized for another vocabulary): the accept rules compare them id by id, and a drafted id past
    the target's vocabulary would index past its embedding."""
    inner = getattr(source, "inner", source)  # TABED's ensemble drafts through one ModelDraftSource
    if isinstance(inner, ModelDraftSource):
        if inner.vocab is not None:
            width, what, fix = inner.vocab.target_width, f"the draft source's vocab.target_width={inner.vocab.target_width}", "build its VocabFit for this target"
        else:
            width = output_width(inner.runner.model)
            what = f"the draft model's output layer has {width} rows"
            fix = "pass vocab=VocabFit.for_pair(target, draft, len(tokenizer)) to the draft source (specdec.models.vocab; SpeculativeDecoder does this)"
    elif isinstance(source, LookupDraftSource):
        width, what, fix = source.vocab_size, f"the lookup source's vocab_size={source.vocab_size}", "build it with vocab_size=output_width(target) (specdec.models.vocab)"
    else:
        return
    target_width = output_width(target)
    if width != target_width:
        raise SpecDecError(f"{what}, but the target's logits are {target_width} wide; {fix}")


def _check_eos_ids(value: object, vocab_size: int | None) -> set[int]:
    """The EOS ids as a set of ints; a SpecDecError for a lone id, a string, ids that are not
    integers (a set of tensors or strings would never match a token: rows would never stop at EOS)
    or ids outside the target's vocabulary (`vocab_size` rows; it can never emit them)."""
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (int, str, bytes)) or value is None or not isinstance(value, Iterable):
        fix = f"; pass [{value}] for one id" if isinstance(value, int) and not isinstance(value, bool) else ""
        raise SpecDecError(f"eos_token_ids={value!r} must be a list of integer token ids (empty: no EOS){fix}")
    ids = list(value)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise SpecDecError(f"eos_token_ids holds {token!r}, not an integer token id; pass integer ids, e.g. [tokenizer.eos_token_id]")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            span = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise SpecDecError(
                f"eos_token_ids holds {token}, outside the target's token ids ({span}): no row could ever stop on it; "
                "pass the EOS ids of this target's tokenizer (tokenizer.eos_token_id), or [] for no EOS"
            )
    return {int(token) for token in ids}


class SpeculativeEngine:
    """Target model + tree policy + draft source + accept rule.

    The engine owns the KV caches (of its target `ModelRunner` and its draft source), so it
    runs one `DecodeSession` at a time; build one engine per concurrent session.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        policy: TreePolicy,
        rule: AcceptRule,
        source: DraftSource | None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        max_context: int | None = None,
        static_shapes: bool = False,
        cuda_graphs: bool = False,
        max_draft_rows: int | None = None,
    ) -> None:
        """static_shapes, cuda_graphs: the target runner's forward mode (`ModelRunner`; the
        draft source's runner gets its own). max_draft_rows: a step with more active rows than
        this drafts nothing (`check_max_draft_rows`); None: no limit."""
        _check_parts(target, policy, rule, source)
        if policy.uses_draft and source is None:
            raise SpecDecError(f"method {policy.name!r} needs a draft model; pass --draft or use --method ar")
        if policy.uses_draft:
            _check_source_width(target, source)
        self.max_draft_rows = check_max_draft_rows(max_draft_rows)
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1):
            raise SpecDecError(f"max_context={max_context!r} must be a positive integer (the most tokens a row may hold), or None for no limit")
        vocab_size = embedding_rows(target)
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral) or pad_token_id < 0 or (vocab_size is not None and pad_token_id >= vocab_size):
            span = f" in 0..{vocab_size - 1}" if vocab_size is not None else " >= 0"
            raise SpecDecError(
                f"pad_token_id={pad_token_id!r} must be a token id{span} (left padding, masked out); "
                "pass the tokenizer's pad_token_id, or its EOS id when it has none"
            )
        self.lazy_draft_prefill = True
        """with `max_draft_rows`: a prompt admitted into a batch over the limit (or starting one) is
        prefilled into the draft model only before the first step that drafts (False: at admission,
        as without a limit)"""
        self.target = ModelRunner(target, static_shapes=static_shapes, cuda_graphs=cuda_graphs)
        self.policy = policy
        self.rule = rule
        self.source = source if policy.uses_draft else None
        self.eos_token_ids = _check_eos_ids(eos_token_ids, vocab_size)
        self.pad_token_id = int(pad_token_id)
        self.max_context = max_context
        self.device = self.target.device
        self.multimodal = is_multimodal(target)
        self.image_problem = image_prompt_problem(target.config, target) if self.multimodal else None
        """why prompts with images would not decode exactly with this target (None: they do)"""
        self.vocab_size = vocab_size
        """rows of the target's input embedding: prompt token ids must be below it (None: unknown)"""
        self.cache_batches = 0
        """batches the KV caches have held (counted at each new batch's prefill, and at `warm_up`):
        a session whose batch is not the last has lost its rows' caches (a count, not the
        session: a reference back would keep an engine and its caches alive past its last use)"""

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def check_prompt(self, prompt: Sequence[int], max_new_tokens: int, name: str = "the prompt") -> None:
        """A SpecDecError naming `name` when the prompt cannot be decoded (empty, images for a
        text-only target, longer than the context with max_new_tokens, token ids outside the vocabulary)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise SpecDecError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
        if isinstance(prompt, MultimodalPrompt) and prompt.model_inputs and not self.multimodal:
            model_type = getattr(self.target.model.config, "model_type", "?")
            raise SpecDecError(
                f"{name} has {max(len(prompt.images), 1)} image(s) but the target ({model_type}) is a text-only model for specdec "
                "(it reads images through a config's vision_config: LLaVA-family models); use a vision-language (LLaVA-family) target or drop the images"
            )
        if isinstance(prompt, MultimodalPrompt) and prompt.model_inputs and self.image_problem is not None:
            model_type = getattr(self.target.model.config, "model_type", "?")
            raise SpecDecError(
                f"{name} has {max(len(prompt.images), 1)} image(s), but the target ({model_type}) {self.image_problem}: "
                "its outputs would not be the model's own; use a LLaVA-family target, text-only prompts, or transformers' generate() for prompts with images"
            )
        if len(prompt) == 0:
            raise SpecDecError(f"{name} is empty (0 tokens); give at least one token of text")
        if self.max_context is not None and len(prompt) + max_new_tokens > self.max_context:
            whose = self._context_owner()
            longer = ", or use a draft with a longer context" if whose == "the draft model's" else ""
            if len(prompt) >= self.max_context:
                raise SpecDecError(f"{name} has {len(prompt)} tokens but {whose} context is {self.max_context}; shorten the prompt{longer}")
            raise SpecDecError(
                f"{name} ({len(prompt)} tokens) + max_new_tokens={max_new_tokens} exceeds {whose} context of "
                f"{self.max_context} tokens; lower max_new_tokens to at most {self.max_context - len(prompt)}{longer}"
            )
        if not isinstance(prompt, MultimodalPrompt):  # a processor's ids: image tokens may lie past the text vocabulary
            self._check_token_ids(prompt, name)

    def _check_token_ids(self, prompt: Sequence[int], name: str) -> None:
        """A SpecDecError naming `name` when a token id is not one of the target's (negative, or
        past its input embedding), instead of an IndexError inside the model."""
        if isinstance(prompt, str):
            raise SpecDecError(f"{name} is a string ({prompt[:40]!r}); the engine takes token ids: encode it first (tokenizer.encode, or SpeculativeDecoder.generate for text)")
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex():
                raise SpecDecError(f"{name} is a {prompt.dtype} tensor of shape {list(prompt.shape)}; give one prompt's integer token ids (a 1-D list)")
        elif not all(type(token) is int for token in prompt):  # (min/max below would also order floats, and strings among themselves)
            for token in prompt:  # numpy integers pass
                if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                    raise SpecDecError(f"{name} holds {token!r}, not an integer token id; give a list of integer token ids")
        try:
            low, high = min(prompt), max(prompt)
        except TypeError:
            raise SpecDecError(f"{name} must be a list of integer token ids") from None
        top = self.vocab_size
        for bad in (low, high):
            if bad < 0 or (top is not None and bad >= top):
                span = f"0..{top - 1}" if top is not None else "0 and up"
                raise SpecDecError(f"{name}: token id {bad} is outside the vocabulary ({span}); give ids from the target's tokenizer")

    def _validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if isinstance(prompts, torch.Tensor) or (hasattr(prompts, "shape") and hasattr(prompts, "tolist")):
            # (a numpy array too) `not prompts` would be an ambiguous truth value; rows of a padded batch carry their padding
            raise SpecDecError(
                f"prompts is {'a tensor' if isinstance(prompts, torch.Tensor) else 'an array'} {list(prompts.shape)}; pass a list of token-id lists, "
                "one per prompt, without padding (e.g. ids.tolist() for rows of equal length)"
            )
        if isinstance(prompts, str):
            raise SpecDecError(f"prompts is a string ({prompts[:40]!r}); the engine takes token ids: encode it first (tokenizer.encode, or SpeculativeDecoder.generate for text)")
        if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
            fix = "list(prompts)" if isinstance(prompts, Iterable) and not isinstance(prompts, (str, bytes, dict)) else "[ids] for one prompt"
            raise SpecDecError(f"prompts must be a list of token-id lists, one per prompt, got {type(prompts).__name__}; pass {fix}")
        if not prompts:
            raise SpecDecError("no prompts given; pass at least one prompt")
        if isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool):
            raise SpecDecError(f"prompts is a list of {len(prompts)} integers; pass a list of token-id lists, one per prompt (e.g. [ids] for one prompt)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise SpecDecError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
        for i, prompt in enumerate(prompts):
            self.check_prompt(prompt, max_new_tokens, f"prompt {i}")

    def session(
        self, params: SamplingParams | None = None, seed: int | None = None, max_rows: int | None = None, keep_steps: bool = False
    ) -> DecodeSession:
        """A step-by-step decode loop over this engine (see `DecodeSession`). A cost-aware
        policy (cast) gets its cost table ready for `max_rows` rows here, before any step."""
        session = DecodeSession(self, params, seed=seed, max_rows=max_rows, keep_steps=keep_steps)  # (checks its arguments before any cost is measured)
        prepare = getattr(self.policy, "prepare_costs", None)
        if callable(prepare) and max_rows is not None:
            prepare(max_rows)
        return session

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        seed: int | None = None,
        stream: StreamCallback | None = None,
        keep_steps: bool = False,
        batch_size: int | None = None,
        stop: StopCallback | None = None,
    ) -> list[EngineOutput]:
        """Decode every prompt (token ids, or a `MultimodalPrompt` for a LLaVA-family target);
        returns one output per prompt, in order.

        Up to `batch_size` prompts (default: all) are decoded together as rows of one batch.
        A row that finishes retires; while prompts wait, the next one is prefilled into the
        free row at the next step boundary. `stream(prompt_index, tokens)` gets each
        prompt's newly committed tokens.

        `stop(prompt_index, tokens)`, called after `stream` with the same tokens, ends that
        prompt when it returns True: finish_reason 'stop', its row freed at the next step
        boundary (`DecodeSession.cancel`). Text-level rules such as stop strings live above
        the engine, which knows only token ids (`SpeculativeDecoder.generate`); the tokens of
        the step that tripped it stay in the output for that layer to cut.
        """
        params = params or SamplingParams()
        self._validate(prompts, max_new_tokens)
        batch_size = len(prompts) if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise SpecDecError(f"batch_size={batch_size!r} must be a positive integer")
        check_callback(stream, "stream", "stream(prompt_index, new_token_ids)")
        check_callback(stop, "stop", "stop(prompt_index, new_token_ids) -> bool")
        session = self.session(params, seed=seed, max_rows=min(batch_size, len(prompts)), keep_steps=keep_steps)
        on_tokens: TokenCallback | None = None
        if stream is not None or stop is not None:
            def on_tokens(request: DecodeRequest, tokens: list[int]) -> None:
                if stream is not None:
                    stream(request.index, tokens)
                if stop is not None and stop(request.index, tokens):
                    session.cancel(request, "stop")

        forward_s0 = self._forward_s()
        requests = [session.submit(prompt, max_new_tokens, on_tokens) for prompt in prompts]
        while not session.idle:
            session.step()
        forward_s1 = self._forward_s()
        forward_s = None if forward_s0 is None or forward_s1 is None else forward_s1 - forward_s0
        results = []
        for request in requests:
            request.stats.forward_s = forward_s  # every row carries the call's total (`batch_stats`)
            assert request.finish_reason is not None
            results.append(EngineOutput(token_ids=request.token_ids, finish_reason=request.finish_reason, stats=request.stats, steps=session.records))
        return results

    @torch.inference_mode()
    def warm_up(self, batch_sizes: Sequence[int], context: int = 0, max_tokens: int = WARM_UP_TOKENS) -> int:
        """Run (with CUDA graphs: capture) the static-shape forwards of the target and the draft
        model for every node-count bucket up to `max_tokens` at each batch size, over caches with
        room for `context` slots, so that capture costs land here and not in a timed call.
        Returns the number of forwards run; 0 without static shapes. Resets both caches."""
        self.cache_batches += 1  # (a session's running rows lose their caches here)
        runners = [self.target]
        draft_runner = self._draft_runner()
        if draft_runner is not None and draft_runner is not self.target:
            runners.append(draft_runner)
        return sum(runner.warm_up(batch_sizes, context=context, max_tokens=max_tokens) for runner in runners)

    def _draft_runner(self) -> ModelRunner | None:
        """The draft source's model runner (None: no source, or one that runs no model of its own)."""
        runner = getattr(self.source, "runner", None)
        return runner if isinstance(runner, ModelRunner) else None

    def graph_captures(self) -> int:
        """CUDA graphs captured so far for the target and the draft model (0 without graphs)."""
        captures = self.target.graph_captures
        draft_runner = self._draft_runner()
        if draft_runner is not None and draft_runner.graphs is not self.target.graphs:
            captures += draft_runner.graph_captures
        return captures

    def _forward_s(self) -> float | None:
        """Time inside both models' forwards so far; None when a runner does not time them."""
        draft_runner = self._draft_runner()
        if not self.target.time_forwards or (draft_runner is not None and not draft_runner.time_forwards):
            return None
        return self.target.forward_s + (self.source.forward_s if self.source is not None else 0.0)

    def _context_owner(self) -> str:
        """Whose context `max_context` is, for messages: the draft's when only the draft's learned
        positions are that short (a draft with a shorter context than its target's)."""
        target, *draft = self.context_lengths()
        if draft and draft[0] == self.max_context and target != self.max_context:
            return "the draft model's"
        return "the model's"

    def context_lengths(self) -> list[int | None]:
        """The learned positions of the target and of the draft model (None: unbounded)."""
        models = [self.target.model]
        draft_runner = self._draft_runner()
        if draft_runner is not None:
            models.append(draft_runner.model)
        return [context_length(m) for m in models]


def check_session_args(params: object, seed: object, rule: object) -> None:
    """A SpecDecError for sampling params that are not a `SamplingParams` (or that sample, under
    the greedy accept rule: argmax verification of sampled drafts and roots is neither greedy nor
    the target's distribution), or a seed torch cannot take."""
    if params is not None and not isinstance(params, SamplingParams):
        fix = "SamplingParams(**params)" if isinstance(params, dict) else "SamplingParams(temperature=..., top_p=..., top_k=...)"
        raise SpecDecError(f"params must be a specdec.sampling.SamplingParams, got {type(params).__name__}; pass {fix}")
    if params is not None and not params.greedy and getattr(rule, "name", None) == "greedy":
        raise SpecDecError(
            f"the greedy accept rule needs temperature 0 (got temperature={params.temperature}); "
            "build the engine with make_rule('sampling') to sample losslessly, or pass SamplingParams() for greedy decoding"
        )
    check_seed(seed, "seed=")


class PhaseClock:
    """The marks of a decoding step's phases (0: drafting starts, 1: verification starts, 2: it
    ends). On a CPU, wall time. On a CUDA device a phase only queues its kernels (the host waits
    for all of them at the step's one read), so its span there is read from CUDA events, on the
    device's own timeline: the time from the device reaching one mark to reaching the next,
    whether it spent it computing or waiting for the host's launches."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else []
        self.times = [0.0, 0.0, 0.0]

    def mark(self, phase: int) -> float:
        """Record mark `phase` (0, 1 or 2); returns the host's clock (perf_counter) at it."""
        now = self.times[phase] = time.perf_counter()
        if self.cuda:
            self.events[phase].record()
        return now

    def spans(self) -> tuple[float, float]:
        """(drafting, verification) in seconds; on CUDA call it after the step's host read."""
        if self.cuda:
            first, second, third = self.events
            return first.elapsed_time(second) / 1e3, second.elapsed_time(third) / 1e3
        return self.times[1] - self.times[0], self.times[2] - self.times[1]


class DecodeSession:
    """The decode loop of one engine, one step at a time, over a rolling batch of rows.

    `submit` queues a prompt; `step` runs one step boundary and one speculative step:
    finished or cancelled rows retire, waiting prompts are prefilled into free rows (a new
    batch when none runs, extra rows while fewer than `max_rows` run), then every running
    row drafts, verifies and commits together, and rows that finished retire (their rows
    go to waiting prompts at once). `cancel` ends a request; its row is freed at the next
    boundary. `idle` is True when nothing runs or waits.

    One sampling setting and one accept rule (the engine's) apply to the whole session.
    Not thread-safe: one thread submits, cancels and steps (callbacks run inside `step`,
    and may call `cancel`).
    """

    def __init__(
        self, engine: SpeculativeEngine, params: SamplingParams | None = None, seed: int | None = None, max_rows: int | None = None, keep_steps: bool = False
    ) -> None:
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise SpecDecError(f"max_rows={max_rows!r} must be a positive integer (or None for no limit)")
        check_session_args(params, seed, engine.rule)
        self.engine = engine
        self.params = params or SamplingParams()
        self.max_rows = max_rows
        self.keep_steps = keep_steps
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        elif not self.params.greedy:
            self.generator = torch.Generator(device=engine.device)
            self.generator.seed()
        self.waiting: deque[DecodeRequest] = deque()
        self.rows: list[DecodeRequest] = []
        """the request held by each batch row"""
        self.roots = torch.zeros(0, dtype=torch.long, device=engine.device)
        """[len(rows)] the last committed token of each row (the root of its next tree)"""
        self.records: list[StepRecord] = []
        """every step's record (kept only with keep_steps)"""
        self._admit_s = 0.0  # admission time (prefill and first token) since the last step record
        self.steps = 0
        self._submitted = 0
        self._holds_cache = False
        self._cache_batch = 0
        """the engine's `cache_batches` when this session started its batch"""
        self._callback_error: Exception | None = None
        """the first exception an `on_tokens` callback raised in this step (raised at its end)"""
        self._clock = PhaseClock(torch.device(engine.device))

    # ----- requests ------------------------------------------------------------------
    def submit(
        self, prompt: Sequence[int], max_new_tokens: int, on_tokens: TokenCallback | None = None, seed: int | None = None
    ) -> DecodeRequest:
        """Queue a prompt (checked against the context first: SpecDecError); it joins the
        batch at the next step boundary with a free row.

        seed: when the request starts a fresh batch (nothing else runs in the session), the
        session's generator is reseeded with it, so a sampled request that runs alone is
        reproducible; rows that share a batch share the generator (best effort)."""
        self.engine.check_prompt(prompt, max_new_tokens)
        check_seed(seed, "seed=")
        check_callback(on_tokens, "on_tokens", "on_tokens(request, new_token_ids)")
        request = DecodeRequest(
            index=self._submitted,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            on_tokens=on_tokens,
            seed=seed,
            stats=GenerationStats(prompt_tokens=len(prompt)),
            submitted_at=time.perf_counter(),
        )
        self._submitted += 1
        self.waiting.append(request)
        return request

    def cancel(self, request: DecodeRequest, reason: str = "cancelled") -> None:
        """End a request now with `finish_reason` = reason: a waiting one never starts, a
        running one keeps its tokens so far and frees its row at the next step boundary."""
        if not isinstance(reason, str) or not reason:
            raise SpecDecError(f"reason={reason!r} must be a non-empty string (the request's finish_reason), e.g. 'cancelled' or 'stop'")
        if request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason)

    def _holds_engine_caches(self) -> bool:
        """Whether the engine's caches still hold this session's batch (no other session, nor
        `warm_up`, has used them since it started)."""
        return self._cache_batch == self.engine.cache_batches

    @property
    def idle(self) -> bool:
        """Nothing runs (no rows, finished or not) and nothing waits."""
        return not self.rows and not self.waiting

    @torch.inference_mode()
    def release(self) -> None:
        """Free the KV caches of an idle session (its next prompt starts a fresh batch anyway);
        does nothing while rows run."""
        if self.rows or not self._holds_cache:
            return
        if not self._holds_engine_caches():  # another session's batch holds the caches now: not ours to free
            self._holds_cache = False
            return
        self.engine.target.reset(0)
        if self.engine.source is not None:
            self.engine.source.keep_rows([])
        self._holds_cache = False

    @property
    def running(self) -> int:
        """Rows decoding a request that has not finished."""
        return sum(1 for r in self.rows if not r.done)

    @property
    def unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + self.running

    # ----- the loop ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepRecord | None:
        """One step boundary (retire, admit) and, when rows run, one draft/verify/commit step.
        Returns the step's record, or None when no row ran.

        Runs under `torch.inference_mode()` whatever the caller's mode: the state that lives
        from one step and one call to the next (KV caches, the policies' calibration tables, the
        draft source's slot bookkeeping, captured buffers) is then made and updated in one mode.
        Without it, a first call inside `with torch.inference_mode():` made inference tensors
        that a later call outside it could not update in place (DynaTree's and CAST's calibration
        raised "Inplace update to inference tensor outside InferenceMode")."""
        if self.rows and not self._holds_engine_caches() and all(r.done for r in self.rows):
            self.rows, self.roots, self._holds_cache = [], self.roots[:0], False  # nothing left to decode in the lost caches
        if self.rows and not self._holds_engine_caches():
            raise SpecDecError(
                f"this session's {len(self.rows)} row(s) lost their KV caches: another session on the same engine "
                "(or engine.generate, or warm_up) used them since this session's batch started; an engine runs one session at a time: "
                "build one engine per concurrent session (SpeculativeDecoder.make_engine()), and cancel these requests"
            )
        self._retire_and_admit()
        self._fill_rows()
        if not self.rows:
            self._raise_callback_error()
            return None
        self._reencode_rows()
        if all(r.done for r in self.rows):  # the re-encoded rows' tokens finished them
            self._retire_and_admit()
            self._raise_callback_error()
            return None
        record = self._decode_step()
        self._retire_and_admit()
        self._raise_callback_error()
        return record

    def _raise_callback_error(self) -> None:
        """Raise what a callback raised during the step, now that the step is complete (the
        session can step on; the other rows' callbacks of the step have run)."""
        err, self._callback_error = self._callback_error, None
        if err is not None:
            raise err

    def _decode_step(self) -> StepRecord:
        engine, params = self.engine, self.params
        rows = self.rows
        was_active = [not r.done for r in rows]
        dev = engine.device
        remaining = max(r.max_new_tokens - len(r.token_ids) for r in rows if not r.done)
        context_len = engine.target.committed_len()  # [B]
        ctx = DraftContext(
            params=params,
            generator=self.generator,
            max_depth=max(0, remaining - 1),
            active=torch.tensor(was_active, dtype=torch.bool).to(dev, non_blocking=True),
            context_len=context_len,
            host_active=was_active,
            host_context_len=self._host_context_lens(),
        )
        # too many rows to draft for (`max_draft_rows`): a plain step, the policy not asked; the
        # draft source owes the root (forwarded with the next drafted step's tokens)
        limited = engine.source is not None and engine.max_draft_rows is not None and sum(was_active) > engine.max_draft_rows and engine.source.defer(self.roots)
        if not limited and engine.source is not None and engine.max_draft_rows is not None:
            self._prefill_owed_drafts()
        clock = self._clock
        captures = engine.graph_captures()
        t0 = clock.mark(0)
        draft = root_only_draft(self.roots) if limited else engine.policy.draft(engine.source, self.roots, ctx)
        tree = draft.tree
        clock.mark(1)
        prepare = getattr(engine.rule, "prepare", None)
        if prepare is not None:  # (what a rule reads of the tree on the host, on its way before the forward)
            walks = CapturedWalks.for_step(engine.target) if isinstance(engine.rule, (SamplingRule, MarsRule)) and not params.greedy else None
            if walks is None:
                prepare(tree, params)
            else:  # (sampled trees tested on the device: planned and tested as graph replays)
                prepare(tree, params, walks=walks)
        logits = engine.target.forward(tree.tokens, context_len[:, None] + tree.depths, tree.ancestor_mask())  # [B, N, V]
        verdict = engine.rule.verify(tree, logits, params, self.generator)
        clock.mark(2)
        plan_ahead = getattr(engine.policy, "plan_ahead", None)
        if plan_ahead is not None and not limited:  # host work for the next step that needs no verdict: on a GPU it overlaps the verification forward
            plan_ahead()
        result = StepResult.read(tree, verdict)  # the step's one host read
        draft_s, verify_s = clock.spans()  # (after the read: on a GPU every marked kernel is done)
        # keep the root and the accepted path in the target cache (their KV from the verify forward);
        # the path's columns are trimmed to the longest accepted path (known now), so rows that
        # accept alike leave no holes in the cache
        lengths = [len(p) for p in result.accepted_nodes]
        longest = max(lengths)
        path, accepted_len = verdict.path, verdict.accepted_len  # [B, D], [B]
        keep = torch.nn.functional.pad(path[:, :longest], (1, 0))  # [B, 1 + longest]: step slot 0 is the root
        keep_valid = constants.arange(1 + longest, dev)[None, :] <= accepted_len[:, None]
        engine.target.commit(keep, keep_valid, dense=len(set(lengths)) == 1, in_place=tree.chain)  # a chain's accepted nodes lead the step already
        if engine.source is not None:  # the verdict in the source's own node numbering (`Draft.accepted_paths`)
            engine.source.end_step(
                draft.accepted_paths(
                    path,
                    accepted_len,
                    host_tokens=result.accepted_tokens,
                    host_active=was_active,
                    target=TargetPath(logits, torch.arange(len(rows), device=dev), keep, params),  # read only by sources that learn from it
                )
            )
        committed = [0] * len(rows)
        for r, request in enumerate(rows):
            if was_active[r]:
                committed[r] = self._append(request, [*result.accepted_tokens[r], result.bonus[r]])
        record = StepRecord(
            step=self.steps,
            active=was_active,
            drafted=[d if a else 0 for d, a in zip(result.drafted, was_active, strict=True)],
            accepted_len=[len(p) if a else 0 for p, a in zip(result.accepted_nodes, was_active, strict=True)],
            committed=committed,
            relaxed=result.relaxed,
            strict_fallbacks=result.fallbacks,
            tree_depth=result.tree_depth,
            draft_s=draft_s,
            verify_s=verify_s,
            drafted_by_depth=result.drafted_by_depth,
            accepted_depth=[len(p) for p in result.accepted_nodes],
            prompt_index=[r.index for r in rows],
            accepted_nodes=[list(p) if a else [] for p, a in zip(result.accepted_nodes, was_active, strict=True)],
            tree_parents=result.tree_parents,
            step_s=time.perf_counter() - t0,
            graph_captures=engine.graph_captures() - captures,
            admit_s=self._admit_s,
        )
        self._admit_s = 0.0
        for r, request in enumerate(rows):
            if was_active[r]:
                stats = request.stats
                stats.add_step(record, r)
                stats.draft_s += record.draft_s
                stats.verify_s += record.verify_s
        if self.keep_steps:
            self.records.append(record)
        if not limited:
            engine.policy.feedback(record)
        else:  # the policy drafted nothing it could learn from; one that tracks what the draft owes is told
            note = getattr(engine.policy, "note_plain_step", None)
            if callable(note):
                note()
        if engine.source is not None:
            engine.source.feedback(record)
        self.roots = verdict.bonus_tokens
        self.steps += 1
        return record

    def _host_context_lens(self) -> list[int] | None:
        """Committed target tokens per row, known on the host for text prompts: the prompt and
        every generated token but the last (the next root, not cached yet). None when a row's
        prompt has images (the model may expand them)."""
        if any(isinstance(r.prompt, MultimodalPrompt) for r in self.rows):
            return None
        return [len(r.prompt) + len(r.token_ids) - 1 for r in self.rows]

    def _admit(self, incoming: list[DecodeRequest], batch_rows: list[int] | None) -> torch.Tensor:
        """Prefill requests `incoming` (into batch rows `batch_rows`, or as a new batch when None);
        choose and append their first tokens; return those tokens [len(incoming)]."""
        with uncounted():  # admission is not a decoding step (`specdec.hostwork`)
            return self._admit_uncounted(incoming, batch_rows)

    def _admit_uncounted(self, incoming: list[DecodeRequest], batch_rows: list[int] | None) -> torch.Tensor:
        engine = self.engine
        prompts = [r.prompt for r in incoming]
        ids, mask = engine._left_pad(prompts)
        if batch_rows is None:
            seed = next((r.seed for r in incoming if r.seed is not None), None)
            if seed is not None:
                self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        t0 = time.perf_counter()
        forward_s0 = engine._forward_s()
        # target_logits: [B', V], the distribution of each admitted prompt's first new token
        model_inputs = prefill_inputs(prompts, engine.device, engine.target.model)  # pixel values of multimodal prompts (per row where a batch would not be exact)
        if batch_rows is None:
            self._holds_cache = True
            engine.cache_batches += 1
            self._cache_batch = engine.cache_batches
            target_logits = engine.target.prefill(ids, mask, model_inputs, dense=len({len(p) for p in prompts}) == 1)
        else:
            target_logits = engine.target.replace_rows(batch_rows, ids, mask, model_inputs)
        first = choose_tokens(target_logits, self.params, self.generator)  # [B']
        first_ids = first.tolist()  # one read; on a GPU the target's prefill is done only here, so time to first token ends after it
        t1 = time.perf_counter()
        for r, request in enumerate(incoming):
            stats = request.stats
            stats.queue_s = t0 - request.submitted_at
            stats.ttft_s = t1 - t0
            request.admitted_at = t0
            request.forward_s_at_admission = forward_s0
            self._append(request, [first_ids[r]])  # (a streaming caller has its first token now)
        # the draft's prefill after the first tokens: it does not choose them, so it does not
        # delay them (on a GPU its kernels queue behind the read above); it counts as prefill
        if engine.source is not None and self._defers_draft_prefill(incoming, new_batch=batch_rows is None):
            if batch_rows is None:  # a new batch: the draft's cache gets its rows now, each holding its prompt's last token
                # (replaced by the row's whole prefill in `_prefill_owed_drafts`; a row that finishes first never needs more)
                engine.source.prefill(ids[:, -1:], mask[:, -1:], None)
            for request in incoming:  # its batch is over `max_draft_rows`: the draft sees the prompt when it drafts again
                request.draft_prefill_owed = True
        elif engine.source is not None:
            engine.source.prefill(ids, mask, batch_rows, prompts=prompts)
        t2 = time.perf_counter()
        self._admit_s += t2 - t0
        for request in incoming:  # (one that finished at its first token ended before the draft's prefill)
            request.stats.prefill_s = (t1 if request.done else t2) - t0
        return first

    def _defers_draft_prefill(self, incoming: list[DecodeRequest], new_batch: bool = False) -> bool:
        """Whether admitted prompts (joining the running batch, or starting a new one) skip the
        draft's prefill for now: the batch will run more active rows than `max_draft_rows` (its
        steps draft nothing), and the draft is one model reading the target's token ids
        (`_prefill_owed_drafts` catches up, for the rows still running when the batch drafts
        again). A new batch of 8 rows over the limit on the bundled pair had spent 0.47 s of a
        21.6 s rolling run over 64 prompts prefilling prompts into the draft (AMD EPYC CPU). Not a
        new batch with static shapes: its draft cache would start one slot wide and grow to the
        prompts' width mid-call (new storage shapes, whose graphs would be captured there)."""
        engine = self.engine
        limit = engine.max_draft_rows
        if limit is None or not engine.lazy_draft_prefill or type(engine.source) is not ModelDraftSource or engine.source.view is not None:
            return False
        if new_batch and engine.target.static_shapes:
            return False
        if any(isinstance(r.prompt, MultimodalPrompt) for r in incoming):
            return False
        others = sum(1 for r in self.rows if not r.done and all(r is not i for i in incoming))
        return others + len(incoming) > limit

    def _prefill_owed_drafts(self) -> None:
        """Before a step that drafts: prefill into the draft every running row admitted while the
        batch was over `max_draft_rows`, with all it has committed but its root (which the step's
        first draft forward reads); the rows' owed roots are dropped (the prefill holds them)."""
        owed = [r for r, request in enumerate(self.rows) if request.draft_prefill_owed and not request.done]
        if not owed:
            return
        engine = self.engine
        assert engine.source is not None
        with uncounted():  # a prefill, not a decoding step's own work (`specdec.hostwork`)
            ids, mask = engine._left_pad([[*self.rows[r].prompt, *self.rows[r].token_ids[:-1]] for r in owed])
            engine.source.prefill(ids, mask, owed)
        for r in owed:
            self.rows[r].draft_prefill_owed = False

    def _reencode_rows(self) -> None:
        """Before a step: re-encode every running row whose sequence (prompt and tokens) has just
        reached the target's `reencode_length`, as its own `generate()` does there (Phi-3 family
        with LongRoPE, `specdec.models.rope`): the row's target and draft caches are prefilled
        again from its whole sequence, with the long factors everywhere, and those last logits
        choose its next token (the new root). `_append` keeps a step from committing tokens past
        that length: they were verified against the cache as it was."""
        engine = self.engine
        length = engine.target.reencode_length
        if length is None:
            return
        due = [r for r, request in enumerate(self.rows) if not request.done and self._reencodes(request) and len(request.prompt) + len(request.token_ids) == length]
        if not due:
            return
        t0 = time.perf_counter()
        with uncounted():  # a prefill, not a decoding step's own work (`specdec.hostwork`)
            sequences = [[*self.rows[r].prompt, *self.rows[r].token_ids] for r in due]
            ids, mask = engine._left_pad(sequences)  # [len(due), length]
            logits = engine.target.replace_rows(due, ids, mask)  # [len(due), V]
            drafted = [i for i, r in enumerate(due) if not self.rows[r].draft_prefill_owed]  # (an owed row catches up later)
            if engine.source is not None and drafted:
                keep = torch.tensor(drafted, dtype=torch.long, device=ids.device)
                engine.source.prefill(ids[keep], mask[keep], [due[i] for i in drafted], prompts=[sequences[i] for i in drafted])
            first = choose_tokens(logits, self.params, self.generator)  # [len(due)]
            roots = self.roots.clone()
            roots[torch.tensor(due, dtype=torch.long, device=roots.device)] = first.to(roots.device)
            self.roots = roots
            for r, token in zip(due, first.tolist(), strict=True):
                self._append(self.rows[r], [token])
        self._admit_s += time.perf_counter() - t0

    def _reencodes(self, request: DecodeRequest) -> bool:
        """Whether the request's row is re-encoded at the target's `reencode_length` (text prompts:
        a prompt with images has the length the model gives it, not known here)."""
        return self.engine.target.reencode_length is not None and not isinstance(request.prompt, MultimodalPrompt)

    def _fill_rows(self) -> None:
        """Admit waiting prompts while rows are free: a new batch when none runs, otherwise
        extra rows (the batch grows: new rows start as copies of row 0 and are overwritten
        by their prefill). A prompt can finish at its first token, so this repeats."""
        while self.waiting:
            free = (self.max_rows - len(self.rows)) if self.max_rows is not None else len(self.waiting)
            if free <= 0:
                return
            incoming = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            if not self.rows:
                self.rows = incoming
                self.roots = self._admit(incoming, None)
            else:
                old = len(self.rows)
                order = list(range(old)) + [0] * len(incoming)
                # a host list: the rows a cut left behind are reused when there are enough, and a
                # batch growing past them moves into storage with room to grow on (on a CPU)
                self.engine.target.keep_rows(order, room=self.max_rows)
                if self.engine.source is not None:
                    keep_source_rows(self.engine.source, order, self.max_rows)
                self.rows = self.rows + incoming
                first = self._admit(incoming, list(range(old, old + len(incoming))))
                self.roots = torch.cat([self.roots, first.to(self.roots.device)])
            self._retire_and_admit()

    def _retire_and_admit(self) -> None:
        """Between steps: finished rows take the next waiting prompts, or leave the batch (with
        static shapes they stay, inactive, until every row has finished).

        A prompt can finish at its first token (EOS, or max_new_tokens=1), so admission
        repeats until every row is live or nothing waits.

        When every row has finished, the batch ends here and the waiting prompts start a new one
        at the next boundary (`_fill_rows`: one prefill, grouped by length, into a cache as wide
        as they need) instead of being spliced into the old cache, whose width the longest old
        row set (AR over 64 held-out prompts, B = 16, rolling: 1.1-1.2x the wall time of groups
        when they were spliced in). With static shapes only when as many prompts wait as the
        batch has rows: a smaller new batch would be a new shape (graphs captured mid-call), so
        fewer are spliced in and the finished rows ride along."""
        new_batch = all(request.done for request in self.rows) and (not self.engine.target.static_shapes or len(self.waiting) >= len(self.rows))
        while not new_batch and (admit_into := [r for r, request in enumerate(self.rows) if request.done][: len(self.waiting)]):
            incoming = [self.waiting.popleft() for _ in admit_into]
            first = self._admit(incoming, admit_into)
            roots = self.roots.clone()
            for r, request, tok in zip(admit_into, incoming, first.tolist(), strict=True):
                self.rows[r] = request
                roots[r] = tok
            self.roots = roots
        # the unfinished rows, finished rows' places taken by rows from the end (`hole_filling_order`):
        # the caches copy only the rows that move
        keep = hole_filling_order([request.done for request in self.rows])
        if keep and len(keep) < len(self.rows) and self.engine.target.static_shapes and self._riders_fit():
            # static shapes (CUDA graphs): finished rows ride along inactive (root-only trees) until
            # every row has finished or a prompt takes their place; a smaller batch is a new shape,
            # whose graphs would be captured mid-call, at every size a shrinking batch passes through
            return
        if len(keep) < len(self.rows):
            engine = self.engine
            if keep:
                engine.target.keep_rows(keep)
                if engine.source is not None:
                    engine.source.keep_rows(keep)
            self.rows = [self.rows[r] for r in keep]
            self.roots = self.roots[torch.tensor(keep, dtype=torch.long, device=self.roots.device)] if keep else self.roots[:0]

    def _riders_fit(self) -> bool:
        """Whether the finished rows can ride along to the end of the batch inside the models'
        context: a riding row's caches grow by its root each step (one slot, at the next
        position), for at most as many steps as the longest unfinished row has tokens left (each
        step commits at least one). A row near the end of a model's learned positions would index
        past them, so then the rows leave as without static shapes. Prompts with images (whose
        length the model may expand) always leave."""
        limits = [n for n in (self.engine.max_context, *self.engine.context_lengths()) if n is not None]
        if not limits:
            return True
        if any(isinstance(r.prompt, MultimodalPrompt) for r in self.rows):
            return False
        left = max(r.max_new_tokens - len(r.token_ids) for r in self.rows if not r.done)
        ridden = [len(r.prompt) + len(r.token_ids) + self.steps - (self.steps if r.finished_step is None else r.finished_step) for r in self.rows if r.done]
        return max(ridden) + left + 1 <= min(limits)

    def _append(self, request: DecodeRequest, new: list[int]) -> int:
        """Append `new` to a request's output, cutting at EOS and at its budget; returns the
        number kept. Finishes the request (and its wall time) when it stops."""
        room = request.max_new_tokens - len(request.token_ids)
        reencode_length = self.engine.target.reencode_length
        if reencode_length is not None and self._reencodes(request):  # no token past the length where the target re-encodes the row (`_reencode_rows`)
            length = len(request.prompt) + len(request.token_ids)
            if length < reencode_length:
                room = min(room, reencode_length - length)
        kept = new[:room]
        finish = None
        for i, tok in enumerate(kept):
            if tok in self.engine.eos_token_ids:
                kept = kept[: i + 1]
                finish = "eos"
                break
        request.token_ids.extend(kept)
        if finish is None and len(request.token_ids) >= request.max_new_tokens:
            finish = "length"
        if finish is not None:
            self._finish(request, finish)
        if request.on_tokens is not None and kept:
            try:
                request.on_tokens(request, kept)
            except Exception as err:  # raised when the step is done: raised here, it left the step half-committed (caches
                # advanced, roots and the draft source not), and a session stepped on after it decoded wrong tokens
                if self._callback_error is None:
                    self._callback_error = err
        return len(kept)

    def _finish(self, request: DecodeRequest, reason: str) -> None:
        request.finish_reason = reason
        request.finished_step = self.steps
        request.stats.new_tokens = len(request.token_ids)
        if request.admitted_at is not None:
            request.stats.wall_s = time.perf_counter() - request.admitted_at
            now = self.engine._forward_s()
            request.stats.forward_s = None if now is None or request.forward_s_at_admission is None else now - request.forward_s_at_admission
