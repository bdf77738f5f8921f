"""Running a benchmark: every method on the same prompts, in the same process, interleaved.

Protocol
- The target, draft and tokenizer are loaded once; every method (our engine's methods and
  the Hugging Face peers) uses the same model objects.
- Warm-up: one short, unmeasured call per method.
- `repeats` rounds; in each, for each group of `batch_size` prompts, every method runs in
  an order shuffled by a fixed-seed RNG, so drift (thermal, background load) hits all alike.
  With `schedule="rolling"` there is one group, every prompt: the engine decodes it as a
  rolling batch of `batch_size` rows (a finished row's place goes to the next prompt at the
  next step boundary, as `specdec serve` batches), so a group's ragged end, where its last
  rows decode alone, comes once per call instead of once per group. HF's `generate()` cannot
  roll: its batched peer decodes the groups back to back inside the one timed call.
- Multi-turn prompts: turn 1 is fed, the answer generated; the answer and turn 2 are
  appended and generated again, and so on; every turn is one measured call. Each method
  continues its own conversation (for greedy, lossless methods that is AR's conversation).
- Every call is kept as a `CallRecord`; `specdec.bench.report` turns them into figures.
- `--methods` items may carry their own options and accept rule (`specdec.bench.variants`);
  each becomes one `Variant` with its own decoder over the shared models.
- `quality`: after the measurement, every completion is scored (`specdec.bench.quality`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from rich.markup import escape
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.api import SpeculativeDecoder, resolve_verify
from specdec.bench.config import MeasuredRunConfig
from specdec.bench.defaults import BENCH_METHODS, SCHEDULES
from specdec.bench.divergence import classify
from specdec.bench.pair import LoadedPair, load_pair, pair_paths
from specdec.bench.peers import BATCHED_PEERS, PeerOutput, peer_needs_draft, run_peer, run_peer_batch
from specdec.bench.prompts import BenchPrompt, load_prompts, resolve_prompt_source
from specdec.bench.quality import CODE_PROMPT_MODES, QualityScorer, is_code_prompt
from specdec.bench.variants import BASELINE, Variant, make_variants, parse_method_specs
from specdec.errors import SpecDecError
from specdec.hostwork import HostWorkCounter, sync_device
from specdec.methods import method_uses_draft
from specdec.multimodal.inputs import MultimodalPrompt
from specdec.parsing import check_max_draft_rows
from specdec.progress import progress_bar
from specdec.sampling import SamplingParams
from specdec.stats import GenerationStats, StepRecord, batch_stats, mean_nll
from specdec.text import chat_ids, check_chat_template, has_chat_template
from specdec.verification import make_rule

DEFAULT_METHODS = BENCH_METHODS
"""the --methods default of `specdec bench`"""

__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "BenchConfig",
    "BenchResult",
    "CallRecord",
    "SCHEDULES",
    "Variant",
    "make_variants",
    "parse_methods",
    "parse_verify",
    "run_bench",
]

WARMUP_TOKENS = 16
"""new tokens of each method's unmeasured warm-up call"""

FEW_CALLS = 5
"""timed calls per method below which the report warns that its medians are unsteady"""

TURN_SEPARATOR = "\n\n"
"""joins a multi-turn conversation's answer and next turn when the tokenizer has no chat template"""


@dataclass
class BenchConfig(MeasuredRunConfig):
    """Everything that defines a benchmark run (saved in results.json): the prompts, pair and
    measurement fields of `MeasuredRunConfig`, and these."""

    num_prompts: int | None = 10
    methods: list[str] = field(default_factory=lambda: DEFAULT_METHODS.split(","))
    """`--methods` items, e.g. `chain`, `chain:k=3`, `dynatree:phase=0`, `chain@mars:theta=0.9`"""
    verify: list[str] = field(default_factory=lambda: ["auto"])
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 1
    schedule: str = "groups"
    """how prompts meet the batch (`SCHEDULES`): 'groups' of `batch_size` prompts decoded one group
    after another, each to its last row's end; 'rolling': one rolling batch of `batch_size` rows over
    every prompt (a finished row's place goes to the next prompt)"""
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """per method: the options set on the command line that apply to it"""
    mars_theta: float | None = None
    """theta of the `mars` accept rule (its own default when None)"""
    mars_thetas: list[float] | None = None
    """run every engine method strictly and with `mars` at each of these thetas (implies quality)"""
    quality: bool = False
    """score every completion after the measurement: NLL under the target, code parse share (and AR agreement)"""
    code_prompts: str = "auto"
    """which prompts count as code for the parse share: auto, all, none (`specdec.bench.quality.is_code_prompt`)"""
    draft_source: str = "model"
    """where engine methods get drafts: the draft model, or n-gram `lookup` (the HF peers keep the draft model)"""
    lookup_ngram: int = 3
    cuda_graphs: str = "auto"
    """CUDA graphs of the engine methods' forwards: auto (on for CUDA), on, off"""
    max_draft_rows: int | None = None
    """engine methods: a step with more active rows than this drafts nothing (`check_max_draft_rows`); None: no limit"""
    chat: bool = False
    """send every prompt (each turn a user message) through the tokenizer's chat template (instruct models)"""
    system: str | None = None
    """with `chat`: a system message first in every conversation"""


@dataclass
class CallRecord:
    """One measured call (one turn of one group of prompts, for one method)."""

    label: str
    repeat: int
    group: int
    turn: int
    prompt_ids: list[str]
    context_tokens: list[int]
    """prompt length in tokens per row (after any truncation to the context window)"""
    outputs: list[list[int]]
    """generated token ids per row"""
    finish_reasons: list[str]
    new_tokens: int
    """summed over rows"""
    wall_s: float
    stats: GenerationStats | None
    """the engine's figures (`batch_stats` over the rows); None for peers"""
    row_ttft_s: list[float] = field(default_factory=list)
    """engine methods, per row: time from the call's start to the row's first token (its wait for a
    free batch row, then its prefill)"""
    row_tpot_s: list[float] = field(default_factory=list)
    """engine methods, per row with two or more new tokens: its own time per token after the first
    (`GenerationStats.tpot_s`: the latency of one stream, not the batch's aggregate)"""
    step_tau_max: list[int] = field(default_factory=list)
    """per verification step: tree depth + 1 (tokens the step would commit if all were accepted)"""
    step_draft_s: list[float] = field(default_factory=list)
    step_verify_s: list[float] = field(default_factory=list)
    graph_captures: int = 0
    """CUDA graphs captured during the call's steps (each one's capture time is in `wall_s`; 0 when
    the warm-up captured every shape the call met)"""
    rss_bytes: int = 0
    """process resident set size right after the call"""
    gpu_peak_bytes: int | None = None
    """CUDA only: peak memory allocated by torch during the call"""
    contexts: list[list[int]] = field(default_factory=list, repr=False)
    """the token ids fed per row (kept for quality scoring; not written to results.json)"""
    token_logprobs: list[list[float]] | None = field(default=None, repr=False)
    """quality runs: per row, the target's log-probability of each generated token"""
    parses: list[bool | None] | None = None
    """quality runs: per row, whether prompt + completion parses as Python (None: not a code prompt)"""
    divergences: list[dict[str, Any] | None] | None = None
    """greedy runs: per row, the first divergence from AR's output classified (`specdec.bench.divergence`), None where equal"""
    loops: list[bool] | None = None
    """quality runs: per row, whether the completion ends in a short loop (`specdec.stats.ends_in_loop`)"""

    @property
    def tokens_per_s(self) -> float:
        return self.stats.tokens_per_s if self.stats is not None else (self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0)

    @property
    def unit(self) -> tuple[int, int]:
        """(group, turn): the same work across methods and repeats."""
        return (self.group, self.turn)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "repeat": self.repeat,
            "group": self.group,
            "turn": self.turn,
            "prompt_ids": self.prompt_ids,
            "context_tokens": self.context_tokens,
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "finish_reasons": self.finish_reasons,
            "outputs": self.outputs,
            "stats": self.stats.to_dict() if self.stats is not None else None,
            "row_ttft_s": self.row_ttft_s,
            "row_tpot_s": self.row_tpot_s,
            "step_tau_max": self.step_tau_max,
            "step_draft_s": self.step_draft_s,
            "step_verify_s": self.step_verify_s,
            "graph_captures": self.graph_captures,
            "rss_bytes": self.rss_bytes,
            "gpu_peak_bytes": self.gpu_peak_bytes,
            "nll": [mean_nll(lp) for lp in self.token_logprobs] if self.token_logprobs is not None else None,
            "parses": self.parses,
            "loops": self.loops,
            "divergences": self.divergences,
        }


HOST_WORK_MIN_STEPS = 16
"""`count_host_work` counts prompt groups until it has seen this many decoding steps"""


@dataclass
class BenchResult:
    """The raw outcome of a run."""

    config: BenchConfig
    variants: list[Variant]
    records: list[CallRecord]
    prompts: list[BenchPrompt]
    prompt_file: str
    notes: list[str]
    target_path: str
    draft_path: str | None
    device: str
    dtype: str
    max_context: int | None
    wall_s: float
    host_work: dict[str, dict[str, float]] = field(default_factory=dict)
    """per engine method: ops, ops_all and host_reads per decoding step outside model forwards
    (`specdec.hostwork`), from extra, untimed calls on the first prompt groups (`count_host_work`)"""
    cost_profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    """per cost-aware variant (cast): where its cost table came from (`ProfileSource.to_dict`),
    loaded or measured before the warm-up and the timed calls"""
    policy_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    """per adaptive variant (a policy with `state()`: cast, dynatree): its learned state right
    after the timed calls (calibration, adapted thresholds, plain-vs-drafted times, overheads)"""


# ----- configuration -----------------------------------------------------------------


def parse_methods(text: str) -> list[str]:
    """A `--methods` value -> validated canonical items (`specdec.bench.variants`), AR first
    (always run), duplicates dropped. Plain names stay plain: "chain,hf,chain" -> ["ar", "chain", "hf"]."""
    return [spec.text for spec in parse_method_specs(text)]


def parse_verify(text: str, temperature: float) -> list[str]:
    """Comma-separated accept rules -> resolved rule names (auto: greedy at T=0, sampling above; mars is lossy)."""
    rules: list[str] = []
    for name in (v.strip() for v in text.split(",")):
        if not name:
            continue
        resolved = resolve_verify(name, temperature)
        make_rule(resolved)  # an unknown rule fails here, before any model is loaded
        if resolved not in rules:
            rules.append(resolved)
    if not rules:
        raise SpecDecError("--verify is empty; give greedy, sampling, mars or auto")
    return rules


def config_variants(config: BenchConfig) -> list[Variant]:
    """The variants `config` asks for (validated; see `specdec.bench.variants.make_variants`)."""
    specs = parse_method_specs(config.methods)
    return make_variants(specs, config.verify, config.temperature, config.method_options, config.mars_thetas, config.mars_theta)


def validate_config(config: BenchConfig) -> None:
    """Fail on bad numbers, method items and options before any model is loaded."""
    for name in ("max_new_tokens", "batch_size", "repeats"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise SpecDecError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
    if config.num_prompts is not None and config.num_prompts < 1:
        raise SpecDecError(f"--num-prompts={config.num_prompts!r} must be a positive integer (or 0 for all prompts)")
    if config.system is not None and not config.chat:
        raise SpecDecError("--system goes with --chat (a system message in every chat); add --chat")
    if config.schedule not in SCHEDULES:
        raise SpecDecError(f"--schedule {config.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if config.code_prompts not in CODE_PROMPT_MODES:
        raise SpecDecError(f"--code-prompts {config.code_prompts!r}: choose one of {', '.join(CODE_PROMPT_MODES)}")
    SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
    check_max_draft_rows(config.max_draft_rows)
    config_variants(config)


# ----- conversation contexts -----------------------------------------------------------


def turn_context(
    tokenizer: PreTrainedTokenizerBase,
    prompt: BenchPrompt,
    turn: int,
    previous: list[int] | None,
    answers: list[list[int]],
    eos_token_ids: Sequence[int],
    chat: bool = False,
    system: str | None = None,
) -> list[int]:
    """Token ids fed for `turn` of `prompt`.

    With `chat` (`--chat`, instruct models) every prompt is a conversation: each turn a user
    message, each earlier answer an assistant message, `system` first when given, through
    the tokenizer's chat template (`specdec.text.chat_ids`; no template: SpecDecError).
    Without it, a plain prompt is its text, tokenized as `SpeculativeDecoder.encode` does, and
    a multi-turn conversation uses the chat template when the tokenizer has one; otherwise the
    previous context, the previous answer (EOS dropped) and TURN_SEPARATOR + the next turn.
    """
    if chat or (len(prompt.turns) > 1 and has_chat_template(tokenizer)):
        messages: list[tuple[str, str]] = [("system", system)] if chat and system is not None else []
        for i in range(turn + 1):
            messages.append(("user", prompt.turns[i]))
            if i < turn:
                messages.append(("assistant", tokenizer.decode(answers[i], skip_special_tokens=True)))
        return chat_ids(tokenizer, messages)
    if len(prompt.turns) == 1:
        return list(tokenizer(prompt.turns[0])["input_ids"])
    if turn == 0 or previous is None:
        return list(tokenizer(prompt.turns[0])["input_ids"])
    eos = set(eos_token_ids)
    answer = [t for t in answers[turn - 1] if t not in eos]
    return previous + answer + list(tokenizer(TURN_SEPARATOR + prompt.turns[turn], add_special_tokens=False)["input_ids"])


def image_prompt(decoder: SpeculativeDecoder, prompt: BenchPrompt, max_context: int | None, max_new_tokens: int) -> MultimodalPrompt:
    """A single-turn prompt with images, encoded for the (vision-language) target."""
    if len(prompt.turns) != 1:
        raise SpecDecError(f"prompt {prompt.id}: multi-turn conversations with images are not supported; give the conversation so far as one 'prompt'")
    encoded = decoder.encode(prompt.turns[0], prompt.images)
    if max_context is not None and len(encoded) + max_new_tokens > max_context:
        raise SpecDecError(
            f"prompt {prompt.id} has {len(encoded)} tokens with its images; with --max-new-tokens={max_new_tokens} it exceeds the context of {max_context}"
        )
    return encoded  # type: ignore[return-value]


def fit_context(ids: list[int], max_context: int | None, max_new_tokens: int) -> tuple[list[int], bool]:
    """Keep the last tokens of `ids` so that prompt + max_new_tokens fits the context window."""
    if max_context is None:
        return ids, False
    room = max_context - max_new_tokens
    if room < 1:
        raise SpecDecError(
            f"--max-new-tokens={max_new_tokens} leaves no room for a prompt in the model's context of {max_context} tokens; lower it"
        )
    return (ids[-room:], True) if len(ids) > room else (ids, False)


# ----- the run ------------------------------------------------------------------------


def _load_models(config: BenchConfig, variants: Sequence[Variant]) -> LoadedPair:
    target_path, draft_path = pair_paths(config)
    needs_draft = [
        v.method for v in variants if (v.peer and peer_needs_draft(v.method)) or (not v.peer and method_uses_draft(v.method))
    ]
    if needs_draft and draft_path is None:
        raise SpecDecError(
            f"--methods {', '.join(dict.fromkeys(needs_draft))} need a draft model; pass --draft PATH or drop them from --methods"
        )
    return load_pair(config, target_path, draft_path if needs_draft else None)


class _Runner:
    """Runs one variant on one group of prompts (all turns); holds the shared models."""

    def __init__(self, config: BenchConfig, models: LoadedPair, variants: Sequence[Variant]) -> None:
        self.config = config
        self.models = models
        self.params = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
        self.decoders: dict[str, SpeculativeDecoder] = {}
        for v in variants:
            if not v.peer:
                draft = models.draft if method_uses_draft(v.method) else None
                self.decoders[v.label] = SpeculativeDecoder(
                    models.target, models.tokenizer, draft, method=v.method, verify=v.verify, verify_options=v.rule_options,
                    draft_source=config.draft_source, lookup_ngram=config.lookup_ngram, processor=models.processor,
                    cuda_graphs=config.cuda_graphs, max_draft_rows=config.max_draft_rows, **v.options,
                )
        probe = SpeculativeDecoder(models.target, models.tokenizer, models.draft, method=BASELINE, processor=models.processor)
        self.probe = probe
        self.max_context = probe.max_context
        self.eos_token_ids = probe.eos_token_ids
        self.pad_token_id = probe.pad_token_id
        self.process = psutil.Process()
        self.assistant_start = models.draft.generation_config.num_assistant_tokens if models.draft is not None else None
        self.truncated: set[tuple[str, int]] = set()

    def prepare_costs(self) -> dict[str, dict[str, Any]]:
        """Every cost-aware variant's cost table (cast) loaded, or measured with its own progress
        bar, for this run's batch size, before any warm-up or timed call, so that no measurement
        lands in a timed run; where each came from, by variant label."""
        sources: dict[str, dict[str, Any]] = {}
        for label, decoder in self.decoders.items():
            for source in decoder.prepare_costs(self.config.batch_size, progress=self.config.progress).values():
                sources[label] = source.to_dict()
        return sources

    def capture_graphs(self, groups: Sequence[Sequence[BenchPrompt]]) -> None:
        """With CUDA graphs on, capture every node-count bucket's forwards of both models before
        anything is timed, at every group's batch size (caches sized for the longest prompt plus
        the new tokens; a batch keeps its size while its rows finish); shapes this misses (a cache
        that grew wider) are captured on first use, in the first repeat."""
        decoders = [d for d in self.decoders.values() if d.cuda_graphs]
        if not decoders:
            return
        longest = max(len(self.models.tokenizer(TURN_SEPARATOR.join(p.turns))["input_ids"]) for g in groups for p in g)
        if self.max_context:
            longest = min(longest, self.max_context)
        with_draft = next((d for d in decoders if d.draft is not None), decoders[0])
        sizes = {min(len(g), self.config.batch_size) for g in groups}  # a last, smaller group is a batch size too; a rolling batch keeps its rows
        with_draft.warm_up(sorted(sizes), context=longest + self.config.max_new_tokens)

    def seed(self, repeat: int, group: int, turn: int) -> int:
        """The same seed for every method on the same call."""
        return (self.config.seed + 1_000_003 * (repeat + 1) + 1_009 * group + turn) % 2**31

    def run_group(
        self,
        variant: Variant,
        prompts: Sequence[BenchPrompt],
        repeat: int,
        group: int,
        max_new_tokens: int | None = None,
        turns: int | None = None,
    ) -> list[CallRecord]:
        """Every turn of `prompts` (decoded together: as one batch, or as a rolling batch of
        `batch_size` rows when there are more) with `variant`; one record per turn."""
        max_new = max_new_tokens or self.config.max_new_tokens
        n_turns = turns or max(len(p.turns) for p in prompts)
        previous: list[list[int] | None] = [None] * len(prompts)
        answers: list[list[list[int]]] = [[] for _ in prompts]
        records: list[CallRecord] = []
        for turn in range(n_turns):
            rows = [i for i, p in enumerate(prompts) if turn < len(p.turns)]
            if not rows:
                break
            contexts: list[list[int]] = []
            for i in rows:
                ids, cut = self.context(prompts[i], turn, previous[i], answers[i], max_new)
                if cut:
                    self.truncated.add((prompts[i].id, turn))
                previous[i] = ids
                contexts.append(ids)
            record = self._call(variant, contexts, max_new, self.seed(repeat, group, turn))
            record.repeat, record.group, record.turn = repeat, group, turn
            record.prompt_ids = [prompts[i].id for i in rows]
            record.contexts = contexts
            for i, out in zip(rows, record.outputs, strict=True):
                answers[i].append(out)
            records.append(record)
        return records

    def context(
        self, prompt: BenchPrompt, turn: int, previous: list[int] | None, answers: list[list[int]], max_new: int
    ) -> tuple[list[int] | MultimodalPrompt, bool]:
        """What turn `turn` of `prompt` feeds the decoder, and whether it was cut to fit the context:
        a prompt with images is encoded by the target's processor and never cut; text goes through
        `turn_context` and `fit_context`."""
        if prompt.images:
            return image_prompt(self.probe, prompt, self.max_context, max_new), False
        ids = turn_context(self.models.tokenizer, prompt, turn, previous, answers, self.eos_token_ids, self.config.chat, self.config.system)
        return fit_context(ids, self.max_context, max_new)

    def policy_states(self, variants: Sequence[Variant]) -> dict[str, dict[str, Any]]:
        """Per variant whose policy adapts (has `state()`): that state, JSON-ready."""
        states = {}
        for v in variants:
            decoder = self.decoders.get(v.label)
            state = getattr(getattr(decoder, "policy", None), "state", None)
            if callable(state):
                states[v.label] = json.loads(json.dumps(state(), default=float))
        return states

    def count_host_work(self, variant: Variant, groups: Sequence[Sequence[BenchPrompt]], min_steps: int = HOST_WORK_MIN_STEPS) -> dict[str, float]:
        """Ops, host reads and the bytes they copy per decoding step outside model forwards (`specdec.hostwork`) on the
        first turns of the prompt groups, in untimed calls (the counting itself is slow): group
        after group until `min_steps` decoding steps were counted (a prompt the model ends at
        once, with EOS as its first token, has no step to count), or the groups run out."""
        ops = ops_all = reads = read_bytes = steps = 0
        for prompts in groups:
            contexts = [self.context(p, 0, None, [], self.config.max_new_tokens)[0] for p in prompts]
            with HostWorkCounter() as counter:
                outs = self.decoders[variant.label].generate_ids(
                    contexts, self.config.max_new_tokens, self.params, verify=variant.verify, seed=self.seed(0, 0, 0)
                )
            ops, ops_all, reads = ops + counter.ops, ops_all + counter.ops_all, reads + counter.host_reads
            read_bytes += counter.host_bytes
            steps += max(o.stats.steps for o in outs)  # the rows of a group share their steps
            if steps >= min_steps:
                break
        per = max(1, steps)
        return {"ops": ops / per, "ops_all": ops_all / per, "host_reads": reads / per, "host_bytes": read_bytes / per, "steps": float(steps)}

    def _call(self, variant: Variant, contexts: list[list[int]], max_new: int, seed: int) -> CallRecord:
        """One timed generation; the process RSS (and on CUDA the peak GPU memory) is read right after."""
        device = next(self.models.target.parameters()).device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        record = self._generate(variant, contexts, max_new, seed)
        record.rss_bytes = self.process.memory_info().rss
        if cuda:
            record.gpu_peak_bytes = torch.cuda.max_memory_allocated(device)
        return record

    def _peer_group(self, variant: Variant, contexts: list[list[int]], max_new: int, seed: int) -> tuple[list[PeerOutput], float]:
        """One timed `generate()` of a Hugging Face peer over `contexts` decoded together: each
        row's output and the call's wall time."""
        if len(contexts) == 1:
            out = run_peer(
                variant.method,
                self.models.target,
                self.models.draft,
                contexts[0],
                max_new,
                self.params,
                self.eos_token_ids,
                self.pad_token_id,
                seed,
                assistant_start=self.assistant_start,
            )
            return [out], out.wall_s
        if variant.method not in BATCHED_PEERS:
            raise SpecDecError(f"peer {variant.label} runs only at batch size 1")
        return run_peer_batch(variant.method, self.models.target, contexts, max_new, self.params, self.eos_token_ids, self.pad_token_id, seed)

    def _generate(self, variant: Variant, contexts: list[list[int]], max_new: int, seed: int) -> CallRecord:
        stats: GenerationStats | None = None
        steps: list[StepRecord] = []
        row_ttft_s: list[float] = []
        row_tpot_s: list[float] = []
        if variant.peer:  # HF's generate() cannot roll: more contexts than the batch size are its groups, back to back
            outputs, finish_reasons, new_tokens, wall_s = [], [], 0, 0.0
            for start in range(0, len(contexts), self.config.batch_size):
                rows, group_s = self._peer_group(variant, contexts[start : start + self.config.batch_size], max_new, seed)
                outputs += [r.token_ids for r in rows]
                finish_reasons += [r.finish_reason for r in rows]
                new_tokens += sum(r.new_tokens for r in rows)
                wall_s += group_s
        else:
            decoder = self.decoders[variant.label]
            device = next(self.models.target.parameters()).device
            sync_device(device)
            t0 = time.perf_counter()
            outs = decoder.generate_ids(
                contexts, max_new, self.params, verify=variant.verify, seed=seed, keep_steps=True, batch_size=self.config.batch_size
            )
            sync_device(device)
            wall = time.perf_counter() - t0  # timed like the peers: the whole call, from outside
            steps = outs[0].steps
            stats = batch_stats([o.stats for o in outs], wall_s=wall, steps=steps)
            outputs, finish_reasons, new_tokens, wall_s = [o.token_ids for o in outs], [o.finish_reason for o in outs], stats.new_tokens, stats.wall_s
            row_ttft_s = [o.stats.queue_s + o.stats.ttft_s for o in outs]
            row_tpot_s = [o.stats.tpot_s for o in outs if o.stats.new_tokens > 1]
        return CallRecord(
            label=variant.label,
            repeat=0,  # repeat, group, turn and prompt_ids: set by the caller
            group=0,
            turn=0,
            prompt_ids=[],
            context_tokens=[len(c) for c in contexts],
            outputs=outputs,
            finish_reasons=finish_reasons,
            new_tokens=new_tokens,
            wall_s=wall_s,
            stats=stats,
            row_ttft_s=row_ttft_s,
            row_tpot_s=row_tpot_s,
            step_tau_max=[s.tree_depth + 1 for s in steps],
            step_draft_s=[s.draft_s for s in steps],
            step_verify_s=[s.verify_s for s in steps],
            graph_captures=sum(s.graph_captures for s in steps),
        )


def run_bench(config: BenchConfig, variants: Sequence[Variant] | None = None) -> BenchResult:
    """Load the models once, warm every method up, then run the interleaved, repeated measurement.

    variants: run these instead of the ones `config.methods` asks for (e.g. `specdec sweep`'s
    grid); the first must be the AR baseline.
    """
    validate_config(config)
    prompt_file = resolve_prompt_source(config.prompts)
    prompts = load_prompts(prompt_file, config.num_prompts)
    if variants is None:
        variants = config_variants(config)
    elif not variants or variants[0].label != BASELINE:
        raise SpecDecError(f"the first variant must be the {BASELINE} baseline")
    variants = list(variants)
    notes: list[str] = []
    if config.num_prompts is not None and len(prompts) < config.num_prompts:
        notes.append(f"{prompt_file} holds {len(prompts)} prompt(s), fewer than --num-prompts {config.num_prompts}: all {len(prompts)} ran.")
    if config.batch_size > 1:
        images = any(p.images for p in prompts)
        skipped = [v.label for v in variants if v.peer and (v.method not in BATCHED_PEERS or images)]
        if skipped:
            why = "prompts with images" if images else f"HF's {', '.join(sorted({v.method for v in variants if v.label in skipped}))} take one row"
            notes.append(
                f"Hugging Face peers ({', '.join(skipped)}) run only at batch size 1 here ({why}); skipped at --batch-size {config.batch_size}."
                + (" hf runs as one left-padded batched generate() call per group." if any(v.peer and v.label not in skipped for v in variants) else "")
            )
        variants = [v for v in variants if v.label not in skipped]
    if config.temperature > 0:
        notes.append(f"temperature {config.temperature} > 0: outputs are sampled, so the equality check against AR is not applicable.")
    static_groups = [prompts[i : i + config.batch_size] for i in range(0, len(prompts), config.batch_size)]
    groups = [prompts] if config.schedule == "rolling" else static_groups
    # one timed call per turn of each group of prompts, per repeat (`_Runner.run_group`)
    calls = config.repeats * sum(max(len(p.turns) for p in g) for g in groups)
    batching = f"a rolling batch of {config.batch_size}" if config.schedule == "rolling" else f"batches of {config.batch_size}"
    if calls < FEW_CALLS:
        notes.append(
            f"only {calls} timed call(s) per method ({len(prompts)} prompt(s) in {batching}, {config.repeats} repeat(s)): "
            f"medians over so few calls move by several percent between runs on a noisy machine; "
            f"more prompts (--num-prompts) or repeats (--repeats) steady them"
        )

    models = _load_models(config, variants)
    if config.chat:
        check_chat_template(models.tokenizer, models.target_path, "--chat")
        if any(p.images for p in prompts):
            notes.append("--chat: prompts with images are fed as written (the chat template applies to text-only prompts).")
    runner = _Runner(config, models, variants)
    rng = random.Random(config.seed)
    records: list[CallRecord] = []
    t_start = time.perf_counter()
    cost_profiles = runner.prepare_costs()  # before the progress bars below: its own bar, and no measuring in a timed call
    runner.capture_graphs(groups)
    with progress_bar(config.progress) as progress:
        warm = progress.add_task("warm-up", total=len(variants))
        kept: list[Variant] = []
        for v in variants:
            progress.update(warm, description=f"warm-up {escape(v.label)}")
            try:
                runner.run_group(v, static_groups[0], repeat=-1, group=0, max_new_tokens=min(WARMUP_TOKENS, config.max_new_tokens), turns=1)
            except Exception as err:  # a peer that this transformers version or model cannot run is dropped, not fatal
                if not v.peer:
                    raise
                notes.append(f"peer {v.label} was dropped: its warm-up failed with {type(err).__name__}: {err}")
                progress.advance(warm)
                continue
            kept.append(v)
            progress.advance(warm)
        variants = kept
        total = config.repeats * len(groups) * len(variants)
        task = progress.add_task("bench", total=total)
        for repeat in range(config.repeats):
            for g, group in enumerate(groups):
                order = list(variants)
                rng.shuffle(order)
                for v in order:
                    progress.update(task, description=f"repeat {repeat + 1}/{config.repeats} prompt group {g + 1}/{len(groups)} {escape(v.label)}")
                    records.extend(runner.run_group(v, group, repeat, g))
                    progress.advance(task)
    captured: dict[str, int] = {}
    for record in records:
        if record.graph_captures:
            captured[record.label] = captured.get(record.label, 0) + record.graph_captures
    if captured:
        notes.append(
            "CUDA graphs were captured inside timed calls, so their capture time counts against the method: "
            + ", ".join(f"{label} {count}" for label, count in captured.items())
            + " (shapes the warm-up did not meet)."
        )
    policy_states = runner.policy_states(variants)  # before the host-work calls below add to what they learned
    host_work = {v.label: runner.count_host_work(v, static_groups) for v in variants if not v.peer}
    if config.temperature == 0:
        _classify_divergences(records, models.target)
    if config.quality or config.mars_thetas:
        _score_quality(records, prompts, models, runner.eos_token_ids, config)
    if runner.truncated:
        notes.append(
            f"{len(runner.truncated)} prompt turn(s) were cut to their last {runner.max_context - config.max_new_tokens if runner.max_context else 0} tokens "
            f"to fit the model's context of {runner.max_context} with --max-new-tokens {config.max_new_tokens}."
        )
    dev = next(models.target.parameters())
    return BenchResult(
        config=config,
        variants=variants,
        records=records,
        prompts=prompts,
        prompt_file=str(prompt_file),
        notes=notes,
        target_path=models.target_path,
        draft_path=models.draft_path,
        device=str(dev.device),
        dtype=str(dev.dtype).replace("torch.", ""),
        max_context=runner.max_context,
        wall_s=time.perf_counter() - t_start,
        host_work=host_work,
        cost_profiles=cost_profiles,
        policy_states=policy_states,
    )


def _classify_divergences(records: Sequence[CallRecord], target: PreTrainedModel) -> None:
    """Greedy runs: every output that differs from AR's on the same call gets its first
    divergence classified as a numerical tie or a mismatch (`specdec.bench.divergence`)."""
    reference = {(r.repeat, r.group, r.turn): r for r in records if r.label == BASELINE}
    for record in records:
        ar = reference.get((record.repeat, record.group, record.turn))
        if ar is None or record.label == BASELINE:
            continue
        found: list[dict[str, Any] | None] = []
        for context, out, ref in zip(record.contexts, record.outputs, ar.outputs, strict=True):
            div = classify(target, context, out, ref) if out != ref and isinstance(context, list) else None  # image prompts: not classified
            found.append(div.to_dict() if div is not None else None)
        record.divergences = found


def _score_quality(
    records: Sequence[CallRecord],
    prompts: Sequence[BenchPrompt],
    models: LoadedPair,
    eos_token_ids: Sequence[int],
    config: BenchConfig,
) -> None:
    """After the measurement: every row's token log-probabilities under the target and, for
    code prompts, whether it parses, and whether it ends in a short loop (`specdec.bench.quality`);
    stored on the records."""
    scorer = QualityScorer(models.target, models.tokenizer, eos_token_ids)
    by_id = {p.id: p for p in prompts}
    with progress_bar(config.progress) as progress:
        task = progress.add_task("quality", total=len(records))
        for record in records:
            record.token_logprobs = [scorer.logprobs(ctx, out) for ctx, out in zip(record.contexts, record.outputs, strict=True)]
            parses: list[bool | None] = []
            for pid, out, reason in zip(record.prompt_ids, record.outputs, record.finish_reasons, strict=True):
                prompt = by_id[pid]
                code = is_code_prompt(prompt, config.code_prompts) and not config.chat  # a chat reply does not continue the prompt's code
                parses.append(scorer.parses(prompt.turns[0], out, reason) if code else None)
            record.parses = parses
            record.loops = [scorer.loops(out) for out in record.outputs]
            progress.advance(task)
