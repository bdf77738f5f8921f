"""The Python API: `SpeculativeDecoder.from_pretrained(...).generate(...)`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.cost.profile import CostTableResolver, ProfileSource
from specdec.drafting.base import CostAwarePolicy, TreePolicy
from specdec.engine import EngineOutput, SpeculativeEngine, StopCallback, check_session_args
from specdec.errors import SpecDecError
from specdec.methods import make_policy, method_uses_draft
from specdec.models.graphs import check_cuda_graphs, resolve_cuda_graphs
from specdec.models.loading import (
    LoadOptions,
    bundled_draft,
    bundled_target,
    check_loaded_model,
    check_same_tokenizer,
    context_length,
    embedding_rows,
    eos_token_ids,
    is_multimodal_source,
    load_model,
    load_processor,
    load_tokenizer,
    pair_load_options,
)
from specdec.models.static import WARM_UP_TOKENS
from specdec.models.vocab import VocabFit, output_width
from specdec.multimodal.inputs import check_placeholders, count_placeholders, encode_multimodal, is_multimodal, same_image_encoding
from specdec.multimodal.views import (
    CaptionView,
    FullView,
    ModelCaptioner,
    PassThroughView,
    PooledImageView,
    PromptView,
    TextOnlyView,
    TruncatedView,
    parse_views,
)
from specdec.parsing import check_callback, check_max_draft_rows
from specdec.sampling import SamplingParams
from specdec.sources.base import DraftSource
from specdec.sources.ensemble import EnsembleConfig, EnsembleDraftSource, EnsemblePrior
from specdec.sources.lookup import LookupDraftSource
from specdec.sources.model import ModelDraftSource
from specdec.stats import GenerationStats
from specdec.text import CompletionText, Message, chat_ids, chat_prompt, check_chat_template, check_utf8, message_pairs
from specdec.verification import make_rule

if TYPE_CHECKING:
    from PIL import Image


@dataclass
class GenerationResult:
    """One completion."""

    text: str
    """the generated text only (prompt excluded)"""
    token_ids: list[int]
    """the generated token ids only (prompt excluded)"""
    finish_reason: str
    """'eos', 'length', or 'stop' (a stop string: `text` ends just before it)"""
    stats: GenerationStats
    """the decoding's figures (a row ended by a stop string counts the tokens its last step committed)"""


def resolve_verify(verify: str | None, temperature: float) -> str:
    """'auto'/None -> greedy at temperature 0, lossless sampling above it.

    'sampling' and 'mars' work at any temperature (both verify greedily at temperature 0).
    """
    if verify in (None, "auto"):
        return "greedy" if temperature == 0 else "sampling"
    if verify == "greedy" and temperature > 0:
        raise SpecDecError(f"--verify greedy needs temperature 0 (got {temperature}); use --verify sampling to sample losslessly")
    return verify


def rule_options(verify: str | None, verify_options: Mapping[str, Any] | None = None, mars_theta: float | None = None) -> dict[str, Any]:
    """The accept rule's options, checked against `verify` (a SpecDecError names a misfit).

    mars_theta is shorthand for verify_options={"theta": mars_theta}. Options need a rule
    that takes them: with verify None/'auto' (greedy or sampling by temperature) none apply.
    """
    options = dict(verify_options or {})
    if mars_theta is not None:
        if "theta" in options and options["theta"] != mars_theta:
            raise SpecDecError(f"mars_theta={mars_theta!r} and verify_options theta={options['theta']!r} disagree; give one of them")
        options["theta"] = mars_theta
    if verify in (None, "auto"):
        if options:
            raise SpecDecError(f"accept-rule option(s) {', '.join(sorted(options))} need an explicit rule that takes them, e.g. --verify mars")
        return options
    make_rule(verify, **options)  # validates the rule name, option names and values before any model is loaded
    return options


DRAFT_SOURCE_READS_MODEL: dict[str, bool] = {"model": True, "lookup": False, "tabed": True}
"""every `--draft-source` name, and whether it drafts with the draft model"""
DRAFT_SOURCES = tuple(DRAFT_SOURCE_READS_MODEL)
"""every `--draft-source` name"""


def needs_draft_model(method: str, draft_source: str) -> bool:
    """Whether `method` drafting from `draft_source` needs a draft model (names already checked)."""
    return method_uses_draft(method) and DRAFT_SOURCE_READS_MODEL[draft_source]


def check_costs_available(policy: TreePolicy, draft_source: str) -> None:
    """A cost-aware policy (cast) measures its draft model's forwards; with a draft source that
    has no model (n-gram lookup) it needs its costs given (cost_table or cost_profile): say so
    up front, not at the first decoding step."""
    needs = isinstance(policy, CostAwarePolicy) and policy.requires_cost_table
    if needs and not DRAFT_SOURCE_READS_MODEL[draft_source] and policy.cost_table is None and policy.cost_profile is None:
        raise SpecDecError(
            f"--method {policy.name} shapes its trees from the measured forward costs of a draft model, and --draft-source {draft_source} has none; "
            "use --draft-source model (with --draft), or a method that needs no cost tables (--method chain --k 10, or --method dynatree), "
            "or give the costs yourself (--cost-profile PATH from `specdec profile`; cost_table=CostTable in Python)"
        )


def check_draft_source(draft_source: str, lookup_ngram: int) -> None:
    if draft_source not in DRAFT_SOURCES:
        raise SpecDecError(f"--draft-source {draft_source!r} is not known; choose one of {', '.join(DRAFT_SOURCES)}")
    if isinstance(lookup_ngram, bool) or not isinstance(lookup_ngram, int) or lookup_ngram < 1:
        raise SpecDecError(f"--lookup-ngram {lookup_ngram!r} must be a positive integer")


def make_ensemble_config(options: Mapping[str, Any] | EnsembleConfig | None, num_views: int) -> EnsembleConfig:
    """EnsembleConfig from a mapping of its fields (a SpecDecError names an unknown field or bad value)."""
    if isinstance(options, EnsembleConfig):
        config = dataclasses.replace(options)
    else:
        names = {f.name for f in dataclasses.fields(EnsembleConfig)}
        unknown = sorted(set(options or {}) - names)
        if unknown:
            raise SpecDecError(f"ensemble option(s) {', '.join(unknown)} are not known; use {', '.join(sorted(names))}")
        config = EnsembleConfig(**dict(options or {}))
    config.validate(num_views)
    return config


def _role_of(value: Any) -> str:
    """What a constructor argument is, for `_check_positional_roles`' message."""
    if isinstance(value, torch.nn.Module):
        return "a model"
    if hasattr(value, "convert_tokens_to_ids") and callable(value):
        return "a tokenizer"
    return f"a {type(value).__name__}"


def _check_positional_roles(target: Any, tokenizer: Any, draft: Any) -> None:
    """SpeculativeDecoder(target, tokenizer, draft): models where models go and a tokenizer where
    it goes, so arguments in another order (target, draft, tokenizer, as `from_pretrained` takes
    paths) are named, not an AttributeError deep inside."""
    problems = []
    if not isinstance(target, torch.nn.Module) or not hasattr(target, "config"):
        problems.append(f"target is {_role_of(target)}, not a transformers model")
    if isinstance(tokenizer, torch.nn.Module) or tokenizer is None:  # (token-id users may pass any object with pad/eos ids)
        problems.append(f"tokenizer is {_role_of(tokenizer)}, not a tokenizer")
    if draft is not None and (not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config")):
        problems.append(f"draft is {_role_of(draft)}, not a transformers model")
    if problems:
        raise SpecDecError(
            f"SpeculativeDecoder(target, tokenizer, draft): {'; '.join(problems)}; pass them in this order "
            "(or by name), or load from paths with SpeculativeDecoder.from_pretrained(target, draft)"
        )


class SpeculativeDecoder:
    """A target model, an optional draft model sharing its tokenizer, and a method."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        draft: PreTrainedModel | None = None,
        method: str = "chain",
        verify: str | None = None,
        verify_options: Mapping[str, Any] | None = None,
        mars_theta: float | None = None,
        draft_source: str = "model",
        lookup_ngram: int = 3,
        processor: Any = None,
        draft_processor: Any = None,
        views: str | Sequence[str] = "M,T",
        ensemble_options: Mapping[str, Any] | None = None,
        *,
        cuda_graphs: str | bool = "auto",
        static_shapes: bool = False,
        max_draft_rows: int | None = None,
        **method_options: Any,
    ) -> None:
        """cuda_graphs: 'auto' (on for a target on one CUDA device, off elsewhere), 'on' (needs
        CUDA) or 'off': capture the draft and verify forwards as CUDA graphs per batch size and
        node-count bucket (`specdec.models.graphs`); static_shapes: the capturable forward mode
        without graphs (implied by graphs; on CPU for tests);
        processor / draft_processor: the image+text processors of LLaVA-family models
        (prompts with images need the target's);
        views, ensemble_options: for draft_source="tabed", the drafting views ("M,T,C,P",
        tailN) and the weight rule (EnsembleConfig fields: policy, distance, window, ...);
        verify_options: options of the accept rule, e.g. {"theta": 0.9} for verify="mars";
        mars_theta: shorthand for verify_options={"theta": mars_theta};
        draft_source: "model" (the draft model) or "lookup" (n-gram prompt lookup, no draft
        model; `lookup_ngram` is the longest n-gram matched);
        max_draft_rows: a step with more active rows than this drafts nothing (a plain step, as
        AR; `specdec.parsing.check_max_draft_rows`); None (default): every step drafts."""
        _check_positional_roles(target, tokenizer, draft)
        check_draft_source(draft_source, lookup_ngram)
        self.max_draft_rows = check_max_draft_rows(max_draft_rows)
        self.cuda_graphs = _resolve_graphs(cuda_graphs, target)
        self.static_shapes = static_shapes or self.cuda_graphs
        self.draft_source = draft_source
        self.lookup_ngram = lookup_ngram
        self.view_names = parse_views(views)
        self.ensemble_config = make_ensemble_config(ensemble_options, len(self.view_names))
        self._views: list[PromptView] | None = None
        self._cost_resolvers: dict[str | None, CostTableResolver] = {}  # cost tables shared by every policy built here
        self.ensemble_prior = EnsemblePrior()
        """TABED evidence carried from one prompt to the next (see EnsembleConfig.prior)"""
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.processor = processor
        self.draft_processor = draft_processor
        self.multimodal = is_multimodal(target)
        self.method = method
        self.verify = verify
        self.verify_options = rule_options(verify, verify_options, mars_theta)
        self.method_options = dict(method_options)
        self.policy = self.make_policy(method)
        limits = [c for c in (context_length(target), context_length(draft) if draft is not None else None) if c]
        self.max_context = min(limits) if limits else None
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        # padding is masked out, so any id the target embeds will do: the tokenizer's, else EOS, else 0
        # (a pad token added to a tokenizer whose model's embedding was not resized is not one)
        rows = embedding_rows(target)
        pad = next(
            (i for i in (getattr(tokenizer, "pad_token_id", None), *self.eos_token_ids) if isinstance(i, int) and i >= 0 and (rows is None or i < rows)), 0
        )
        self.pad_token_id = pad
        self.vocab_fit = VocabFit.for_pair(target, draft, len(tokenizer)) if draft is not None else None
        """the draft's logits brought to the target's width (checkpoints of one family may pad their vocabularies differently)"""

    @classmethod
    def from_pretrained(
        cls,
        target: str | os.PathLike[str] | PreTrainedModel | None = None,
        draft: str | os.PathLike[str] | PreTrainedModel | None = None,
        method: str = "chain",
        verify: str | None = None,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        verify_options: Mapping[str, Any] | None = None,
        mars_theta: float | None = None,
        draft_source: str = "model",
        lookup_ngram: int = 3,
        views: str | Sequence[str] = "M,T",
        ensemble_options: Mapping[str, Any] | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        processor: Any = None,
        device_map: str | Mapping[str, Any] | None = None,
        quantization: str | None = None,
        draft_quantization: str | None = None,
        attn_implementation: str | None = None,
        revision: str | None = None,
        draft_revision: str | None = None,
        trust_remote_code: bool = False,
        cuda_graphs: str | bool = "auto",
        static_shapes: bool = False,
        max_draft_rows: int | None = None,
        **method_options: Any,
    ) -> SpeculativeDecoder:
        """Load from local folders or hub ids, or take models already loaded; with no target,
        the bundled pair.

        target, draft: a folder (a str or a pathlib.Path), a hub id, or a loaded `PreTrainedModel` (causal LM or
        LLaVA-family), used as it is (its device, dtype, placement). A loaded target needs
        `tokenizer=` (and `processor=` for prompts with images); a loaded draft is trusted to
        share it (a draft loaded here is checked against it). Drafts whose output layer is
        wider or narrower than the target's (padded vocabularies) work: see `specdec.models.vocab`.
        device, dtype: where and how plain loads go ('auto': CUDA in bfloat16 when present,
        else CPU in float32).
        device_map: accelerate's placement for both models ('auto', 'balanced', 'sequential',
        a device or a {module: device} dict); instead of `device`; needs accelerate.
        quantization / draft_quantization: '4bit' or '8bit' (bitsandbytes) for the target /
        draft; a pre-quantized checkpoint loads quantized without it. Placed models are never
        moved after loading.
        attn_implementation: 'eager' or 'sdpa' for both models (tree masks rule out flash attention).
        revision / draft_revision: hub branch, tag or commit of the target / draft.
        trust_remote_code: run modelling code shipped with either checkpoint.
        cuda_graphs: 'auto' (on for CUDA), 'on' (needs CUDA) or 'off'; static_shapes, max_draft_rows: see `__init__`.
        verify="mars" with mars_theta=0.9 (or verify_options={"theta": 0.9}) selects MARS.
        """
        policy = make_policy(method, **method_options)  # fail on bad options before loading anything
        check_cuda_graphs(cuda_graphs, device)  # a bad mode, or 'on' with a CPU device: fail before loading
        check_max_draft_rows(max_draft_rows)
        options = rule_options(verify, verify_options, mars_theta)
        check_draft_source(draft_source, lookup_ngram)
        check_costs_available(policy, draft_source)
        make_ensemble_config(ensemble_options, len(parse_views(views)))
        target_load, draft_load = pair_load_options(
            device_map, quantization, draft_quantization, attn_implementation, revision, draft_revision, trust_remote_code
        )
        target, draft = (os.fspath(m) if isinstance(m, os.PathLike) else m for m in (target, draft))  # a pathlib.Path is a folder
        for role, name in (("target", target), ("draft", draft)):
            if isinstance(name, str) and not name.strip():
                raise SpecDecError(f"{role}={name!r} is empty; give a model folder or hub id, or None (--{role} left out) for the bundled pair's {role}")
        if target is None:
            target = bundled_target()
            draft = draft or bundled_draft()
        needs_draft = needs_draft_model(method, draft_source)
        target_model: PreTrainedModel | None = None
        if isinstance(target, str):
            tokenizer = tokenizer or load_tokenizer(target, "target", target_load)
            if processor is None and is_multimodal_source(target, "target", target_load):
                processor = load_processor(target, "target", target_load)
        else:
            target_model = check_loaded_model(target, "target")
            if tokenizer is None:
                raise SpecDecError("a loaded target model needs its tokenizer: from_pretrained(model, draft, tokenizer=tokenizer)")
            if not (needs_draft and isinstance(draft, str)) and (device, dtype, target_load, draft_load) != (None, None, LoadOptions(), LoadOptions()):
                raise SpecDecError(
                    "device, dtype and the loading options apply to models loaded from a folder or hub id, and none is loaded here; "
                    "place and convert the loaded models yourself, or drop those arguments"
                )
        # where a draft loaded here goes: `device`, else next to a loaded target (a device map places it itself)
        load_device: str | torch.device | None = device
        if target_model is not None and device is None and device_map is None:
            load_device = target_model.device
        draft_model = draft_processor = None
        if needs_draft:
            if draft is None:
                raise SpecDecError(f"--method {method} needs a draft model; pass --draft PATH or use --method ar")
            if isinstance(draft, str):
                check_same_tokenizer(tokenizer, load_tokenizer(draft, "draft", draft_load))
                draft_model = load_model(draft, "draft", load_device, dtype, draft_load)
                if processor is not None and is_multimodal(draft_model):
                    draft_processor = load_processor(draft, "draft", draft_load)
            else:
                draft_model = check_loaded_model(draft, "draft")
        if target_model is None:
            assert isinstance(target, str)
            target_model = load_model(target, "target", load_device, dtype, target_load)
        return cls(
            target_model, tokenizer, draft_model, method=method, verify=verify, verify_options=options,
            draft_source=draft_source, lookup_ngram=lookup_ngram, processor=processor, draft_processor=draft_processor,
            views=views, ensemble_options=ensemble_options, cuda_graphs=cuda_graphs, static_shapes=static_shapes,
            max_draft_rows=max_draft_rows, **method_options,
        )

    def draft_view(self) -> PromptView | None:
        """How the draft model sees prompts with images: the target's own encoding when both
        read images the same way (None), the draft's processor when they differ, text only
        (each `<image>` becomes a newline) for a text-only draft of a vision-language target."""
        if not self.multimodal or self.draft is None:
            return None
        if not is_multimodal(self.draft):
            return TextOnlyView(self.tokenizer)
        if self.draft_processor is None or same_image_encoding(self.target, self.draft, self.processor, self.draft_processor):
            return None
        return FullView(self.draft_processor)

    def make_policy(self, method: str) -> TreePolicy:
        """A fresh tree policy for `method`: with this decoder's method options when it is the
        decoder's own method, with the method's defaults otherwise; bound to the models."""
        policy = make_policy(method, **(self.method_options if method == self.method else {}))
        check_costs_available(policy, self.draft_source)
        if self.lacks_draft_for(method):
            raise SpecDecError(f"--method {method} needs a draft model; pass --draft PATH, use --draft-source lookup, or use --method ar")
        if isinstance(policy, CostAwarePolicy):  # finds or measures the pair's cost profile, once per profile path
            resolver = None
            if self.draft is not None and policy.wants_cost_table(next(self.target.parameters()).device):  # dynatree: only when its free width is measured
                path = policy.cost_profile
                if path not in self._cost_resolvers:
                    self._cost_resolvers[path] = CostTableResolver(self.target, self.draft, path, cuda_graphs=self.cuda_graphs)
                resolver = self._cost_resolvers[path]
            policy.bind_models(self.target, self.draft, resolver=resolver)
        return policy

    def prepare_costs(self, max_batch_size: int, progress: bool = True) -> dict[str | None, ProfileSource]:
        """Get the cost tables of every cost-aware policy built here (cast) ready for batches of
        up to `max_batch_size` rows now: loaded, or measured (with a progress bar when
        `progress`) where no profile fits. Every decode session does this at its start anyway;
        call it first so that no measurement lands inside a generation you time. Returns where
        each table came from, by cost-profile path (None: the default); empty for other methods."""
        return {path: self._prepare_resolver(resolver, max_batch_size, progress) for path, resolver in self._cost_resolvers.items()}

    @staticmethod
    def _prepare_resolver(resolver: CostTableResolver, max_batch_size: int, progress: bool) -> ProfileSource:
        resolver.prepare(max_batch_size, progress=progress)
        return resolver.source

    def lacks_draft_for(self, method: str) -> bool:
        """Whether `method` would draft with a draft model this decoder was built without."""
        return self.draft is None and needs_draft_model(method, self.draft_source)

    def make_source(self, policy: TreePolicy | None = None) -> DraftSource | None:
        """A fresh draft source for one engine run of `policy` (default: the decoder's); None for plain AR."""
        if not (policy or self.policy).uses_draft:
            return None
        if self.draft_source == "lookup":
            return LookupDraftSource(vocab_size=output_width(self.target), max_ngram=self.lookup_ngram)
        if self.draft is None:
            return None
        if self.draft_source == "tabed":
            return EnsembleDraftSource(
                self.draft, self.ensemble_views(), dataclasses.replace(self.ensemble_config), self.ensemble_prior, vocab=self.vocab_fit, **self._draft_modes()
            )
        return ModelDraftSource(self.draft, view=self.draft_view(), vocab=self.vocab_fit, **self._draft_modes())

    def _draft_modes(self) -> dict[str, bool]:
        """The draft runner's forward mode: the target's (graphs only when the draft is on CUDA too)."""
        assert self.draft is not None
        on_cuda = next(self.draft.parameters()).device.type == "cuda"
        return {"static_shapes": self.static_shapes, "cuda_graphs": self.cuda_graphs and on_cuda}

    def warm_up(self, batch_sizes: Sequence[int] = (1,), context: int = 0, max_tokens: int = WARM_UP_TOKENS) -> int:
        """Capture the CUDA graphs (with graphs on) of both models' forwards for every node-count
        bucket up to `max_tokens` at each batch size, over caches with room for `context` slots,
        so that capture costs are not paid inside a timed call (`SpeculativeEngine.warm_up`).
        Returns the number of forwards run; 0 without static shapes."""
        return self.engine(resolve_verify(self.verify, 0.0)).warm_up(batch_sizes, context=context, max_tokens=max_tokens)

    def ensemble_views(self) -> list[PromptView]:
        """The TABED views (built once; the caption view keeps its captions across calls)."""
        if self._views is None:
            self._views = [self.make_view(name) for name in self.view_names]
        return self._views

    def make_view(self, name: str) -> PromptView:
        """A drafting view by name (M, T, C, P or tailN) for this decoder's draft model."""
        assert self.draft is not None
        vision_draft = is_multimodal(self.draft)
        if name.startswith("tail"):
            return TruncatedView(int(name[4:]), self.tokenizer)
        if name == "T":
            return TextOnlyView(self.tokenizer)
        if not self.multimodal:
            if name == "M":
                return PassThroughView()
            raise SpecDecError(f"view {name} needs a vision-language pair; for a text pair use M, T (the same for text) or tailN, e.g. --views M,tail64")
        if not vision_draft:
            raise SpecDecError(f"view {name} needs a vision-language draft; with a text-only draft use T or tailN")
        draft_processor = self.draft_processor or self.processor
        if name == "M":
            view = self.draft_view()
            return view if view is not None else PassThroughView()
        if name == "C":
            return CaptionView(self.tokenizer, ModelCaptioner(self.draft, draft_processor))
        return PooledImageView(self.draft, draft_processor)

    def engine(self, verify: str) -> SpeculativeEngine:
        """An engine with the decoder's policy (shared across calls, so adaptive policies keep learning)."""
        return self._engine(self.policy, verify, self.verify_options)

    def make_engine(self, method: str | None = None, verify: str = "greedy", verify_options: Mapping[str, Any] | None = None) -> SpeculativeEngine:
        """A new engine over the shared models with its own KV caches, draft source and policy
        (`make_policy`): `method` (default: the decoder's), accept rule `verify` with
        `verify_options` (default: the decoder's when `verify` is its rule, else none)."""
        if verify_options is None:
            verify_options = self.verify_options if verify == self.verify else {}
        return self._engine(self.make_policy(method or self.method), verify, verify_options)

    def _engine(self, policy: TreePolicy, verify: str, verify_options: Mapping[str, Any]) -> SpeculativeEngine:
        return SpeculativeEngine(
            self.target,
            policy,
            make_rule(verify, **verify_options),
            self.make_source(policy),
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            max_context=self.max_context,
            static_shapes=self.static_shapes,
            cuda_graphs=self.cuda_graphs,
            max_draft_rows=self.max_draft_rows,
        )

    def encode(self, prompt: str, images: Sequence[str | Path | Image.Image] | None = None) -> Sequence[int]:
        """Token ids of `prompt`; with images, a `MultimodalPrompt` (one `<image>` placeholder per image)."""
        if not isinstance(prompt, str):
            ids = " (for token ids use generate_ids)" if isinstance(prompt, int | torch.Tensor) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)) else ""
            raise SpecDecError(f"prompt must be a string, got {type(prompt).__name__}{ids}")
        if not prompt:
            raise SpecDecError("the prompt is empty; give some text to continue")
        check_utf8(prompt, "the prompt")
        if images:
            if self.processor is None and self.multimodal:
                raise SpecDecError(f"{len(images)} image(s) were given but the decoder has no processor; pass processor= with a loaded vision-language target")
            if self.processor is None:
                raise SpecDecError(
                    f"{len(images)} image(s) were given but the target is a text-only model; "
                    "use a vision-language (LLaVA-family) target, e.g. the bundled LVLM pair (no --target), or drop --image"
                )
            return encode_multimodal(self.processor, prompt, images)
        if self.processor is not None and count_placeholders(prompt):
            check_placeholders(prompt, 0)
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise SpecDecError(f"the target's tokenizer turned the prompt {prompt[:40]!r} into no tokens; check that the model's tokenizer files are complete")
        return ids

    @property
    def model_name(self) -> str:
        """The target's folder or hub id (for messages)."""
        return str(getattr(self.target.config, "_name_or_path", "") or getattr(self.tokenizer, "name_or_path", "") or "the target")

    def chat_prompt(self, messages: Sequence[Message], system: str | None = None) -> str:
        """The prompt text of a chat: the tokenizer's chat template applied to `messages` (dicts
        with role and content, or (role, content) pairs; `system` first when given) with the
        generation prompt added. A tokenizer without a chat template is a one-line SpecDecError."""
        check_chat_template(self.tokenizer, self.model_name, flag="messages=")
        return chat_prompt(self.tokenizer, message_pairs(messages, system), plain_fallback=False)[0]

    def encode_chat(self, messages: Sequence[Message], system: str | None = None, where: str = "messages") -> list[int]:
        """Token ids of `chat_prompt(messages, system)` (the template's special tokens are its own: none are added)."""
        check_chat_template(self.tokenizer, self.model_name, flag="messages=")
        ids = chat_ids(self.tokenizer, message_pairs(messages, system, where))
        if not ids:
            raise SpecDecError(f"the chat template turned {where} into no tokens; check the tokenizer's chat template")
        return ids

    def generate(
        self,
        prompt: str | list[str] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stream: Callable[[int, list[int]], None] | None = None,
        batch_size: int | None = None,
        images: Sequence[Any] | None = None,
        *,
        messages: Sequence[Message] | Sequence[Sequence[Message]] | None = None,
        system: str | None = None,
        stop: str | Sequence[str] | None = None,
        stream_text: Callable[[int, str], None] | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Continue `prompt`, or each prompt of a list: up to `batch_size` (default: all) rows
        are decoded together; finished rows take the next waiting prompt.

        messages: instead of `prompt`, a chat for an instruct model: a list of messages
        ({"role": "user", "content": "Hi"} or ("user", "Hi")), or a list of such lists (a
        batch, one result per chat). The tokenizer's chat template is applied with the
        generation prompt (`chat_prompt`); a tokenizer without one is a SpecDecError.
        system: a system message put first in every chat (messages only).

        stop: a string or strings; a row's text ends just before the first one it produces,
        with finish_reason 'stop', and the row stops decoding at that step (not at
        max_new_tokens). `token_ids` then holds the fewest tokens that give the text (the
        step may have committed more; `stats` counts those). EOS still ends a row.

        stream(index, token_ids): each prompt's newly committed tokens. With stop strings the
        tokens come once their text is final (`stream_text`'s rule) and end with the result's
        `token_ids`, never past them.
        stream_text(index, text): each prompt's newly final text: held back while it could be
        the start of a stop string or ends in an incomplete UTF-8 character, never past a stop
        string; the pieces concatenate to the result's `text` (`specdec.text.CompletionText`,
        the server's streaming).

        seed: makes a sampled call reproducible when it is repeated with the same prompts, in
        the same order, with the same batch_size. Rows of a batch draw from one generator, so
        a seeded prompt's sampled output depends on the prompts batched with it (with every
        method, `ar` included): a prompt sampled alone and the same prompt in a batch give
        different text. Greedy output (temperature 0) never depends on the batch.

        images: for a vision-language target, the images of `prompt` (paths or PIL images,
        one per `<image>` placeholder), or for a list of prompts one such list per prompt."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        verify = resolve_verify(self.verify, temperature)
        stops = stop_strings(stop)
        check_callback(stream, "stream", "called with (index, token_ids)")
        check_callback(stream_text, "stream_text", "called with (index, text)")
        ids: list[Sequence[int]]
        if messages is not None:
            if prompt is not None:
                raise SpecDecError("give either prompt (text to continue) or messages (a chat), not both")
            if images:
                raise SpecDecError("images go with a text prompt holding <image> placeholders, not with messages; pass prompt= and images=")
            single, chats = _split_chats(messages)
            ids = [self.encode_chat(chat, system, where="messages" if single else f"messages[{i}]") for i, chat in enumerate(chats)]
        else:
            if prompt is None:
                raise SpecDecError("give a prompt (text to continue) or messages (a chat for an instruct model)")
            if system is not None:
                raise SpecDecError("system= goes with messages= (a chat); with a plain prompt put the instructions in the prompt text")
            if isinstance(prompt, bytes | bytearray):
                raise SpecDecError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}; decode it first, e.g. prompt.decode('utf-8')")
            if not isinstance(prompt, str | Iterable):
                raise SpecDecError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
            single = isinstance(prompt, str)
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            if images is None:
                per_prompt: list[Any] = [None] * len(prompts)
            elif isinstance(prompt, str):
                per_prompt = [list(images)]
            else:
                per_prompt = list(images)
                if len(per_prompt) != len(prompts) or not all(i is None or isinstance(i, list | tuple) for i in per_prompt):
                    raise SpecDecError(f"images must hold one list of images per prompt ({len(prompts)} prompts, {len(per_prompt)} entries)")
            ids = [self.encode(p, imgs) for p, imgs in zip(prompts, per_prompt, strict=True)]
        if not stops and stream_text is None:
            outputs = self.generate_ids(ids, max_new_tokens, params, verify, seed, stream, batch_size=batch_size)
            results = [self._result(o) for o in outputs]
        else:
            texts = [CompletionText(self.tokenizer, stops) for _ in ids]
            streamer = _TextStreamer(texts, stream, stream_text)
            outputs = self.generate_ids(ids, max_new_tokens, params, verify, seed, batch_size=batch_size, stop=streamer.add)
            results = [streamer.result(i, o) for i, o in enumerate(outputs)]
        return results[0] if single else results

    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        verify: str | None = None,
        seed: int | None = None,
        stream: Callable[[int, list[int]], None] | None = None,
        keep_steps: bool = False,
        batch_size: int | None = None,
        stop: StopCallback | None = None,
    ) -> list[EngineOutput]:
        """Token-level entry point (benchmarks use it); `seed` as in `generate`; `stop(index,
        tokens)` returning True ends that prompt (`SpeculativeEngine.generate`); `params` None: greedy."""
        check_session_args(params, seed, None)  # (before `params.temperature` is read; the engine checks the rule and callbacks)
        params = params or SamplingParams()
        verify = resolve_verify(verify or self.verify, params.temperature)
        return self.engine(verify).generate(
            prompt_ids, max_new_tokens, params, seed=seed, stream=stream, keep_steps=keep_steps, batch_size=batch_size, stop=stop
        )

    def _result(self, out: EngineOutput) -> GenerationResult:
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return GenerationResult(text=text, token_ids=out.token_ids, finish_reason=out.finish_reason, stats=out.stats)


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """`stop` as a list of non-empty strings (a SpecDecError names a bad one)."""
    if stop is None:
        return []
    if not isinstance(stop, str) and (isinstance(stop, bytes) or not isinstance(stop, Sequence)):
        raise SpecDecError(f"stop={stop!r} must be a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise SpecDecError(f"{where}={s!r}: stop strings must be non-empty strings")
    return stops


def _split_chats(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> tuple[bool, list[Sequence[Message]]]:
    """(one chat?, the chats): a list of messages is one chat, a list of lists of messages a batch."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise SpecDecError("messages must be a non-empty list of messages such as {'role': 'user', 'content': 'Hi'}, or a list of such lists")
    first = messages[0]
    if isinstance(first, list):
        return False, list(messages)  # type: ignore[arg-type]
    return True, [messages]  # type: ignore[list-item]


class _TextStreamer:
    """Per prompt: committed tokens -> text cut at stop strings (`CompletionText`), the stream
    callbacks fed with what is final, and the call's results."""

    def __init__(self, texts: list[CompletionText], stream: Callable[[int, list[int]], None] | None, stream_text: Callable[[int, str], None] | None) -> None:
        self.texts = texts
        self.stream = stream
        self.stream_text = stream_text
        self.sent_tokens = [0] * len(texts)

    def add(self, index: int, tokens: list[int]) -> bool:
        """The engine's stop callback: True once the prompt's text reached a stop string."""
        text = self.texts[index]
        delta = text.add(tokens)
        if self.stream is not None:
            if text.stopped:
                self._send_tokens(index, text.token_count)
            elif not text.pending:  # nothing held back: every token so far is final
                self._send_tokens(index, len(text.token_ids))
        if delta and self.stream_text is not None:
            self.stream_text(index, delta)
        return text.stopped

    def _send_tokens(self, index: int, upto: int) -> None:
        assert self.stream is not None
        new = self.texts[index].token_ids[self.sent_tokens[index] : upto]
        if new:
            self.sent_tokens[index] = upto
            self.stream(index, new)

    def result(self, index: int, out: EngineOutput) -> GenerationResult:
        """The prompt's result, after streaming what was still held back."""
        text = self.texts[index]
        rest = text.finish()
        if rest and self.stream_text is not None:
            self.stream_text(index, rest)
        if text.stopped:
            return GenerationResult(text=text.text, token_ids=out.token_ids[: text.token_count], finish_reason="stop", stats=out.stats)
        if self.stream is not None:
            self._send_tokens(index, len(out.token_ids))
        return GenerationResult(text=text.text, token_ids=out.token_ids, finish_reason=out.finish_reason, stats=out.stats)


def _resolve_graphs(mode: str | bool, target: PreTrainedModel) -> bool:
    """`resolve_cuda_graphs` for a loaded target: 'auto' is off for a model spread over several
    devices (a device map), where one graph cannot hold the forward."""
    placement = getattr(target, "hf_device_map", None) or {}
    devices = {str(d) for d in placement.values()}
    device = next(target.parameters()).device
    if len(devices) > 1 and mode in ("auto", None):
        return False
    return resolve_cuda_graphs(mode, device)
