"""Per-step records and every metric, defined once.

- **τ (tau)**: mean tokens committed per verification step when nothing is cut off,
  i.e. mean of (accepted_len + 1) over steps: accepted draft tokens plus the bonus token.
- **acceptance rate**: accepted draft tokens / drafted tokens (drafted = tree nodes
  sent to verification, root excluded). For a tree this counts every sibling drafted.
- **tokens/s**: new tokens / wall time of the whole call (prefill included).
- **TTFT**: time from the call to the first new token (prefill + its choice).
- **TPOT**: (wall time - TTFT) / (new tokens - 1): the time per later token.
- **engine efficiency**: share of wall time spent inside model forwards.
- **upper-bound speedup**: the speedup over AR a tree shape would reach if every drafted
  path were accepted fully, from measured per-step costs (`upper_bound_speedup`).
- **batch figures**: a batched call counts the summed tokens of its rows over the call's
  wall time (`batch_stats`).

Quality figures (for lossy rules such as MARS; `specdec bench --quality`), each against
the plain AR output of the same prompt, turn and repeat:

- **AR prefix agreement** (the MARS paper's "precision"): tokens equal to AR's at the same
  position up to the first divergence, over max(len(output), len(AR)) (`prefix_agreement`);
- **AR token agreement**: tokens equal to AR's at the same position anywhere in the
  sequence, over the same denominator (`position_agreement`);
- **exact match**: share of completions identical to AR's (`exact_match_share`);
- **NLL**: the target's mean negative log-likelihood (nats per token, raw logits, i.e.
  temperature 1 and no top-k/top-p) of the generated tokens given the prompt (`mean_nll`);
- **parses**: share of code completions for which prompt + completion, cut at the last
  complete line, is valid Python and the kept completion holds code, not only blank lines
  and `#` comments (`code_parses`, `parse_share`);
- **loops** (degeneracy): share of completions whose last half is one unit of at most
  `LOOP_MAX_PERIOD` tokens repeated (`ends_in_loop`, `loop_share`);
- **relaxed share**: accepted tokens a lossy rule accepted by relaxation / all accepted
  draft tokens (`relaxed_share`).
Reports, benchmarks and tests use these functions and properties, nothing else.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


def tau(accepted_lens: Sequence[int]) -> float:
    """Mean committed tokens per verification step: mean(accepted_len + 1); 0 without steps."""
    return sum(a + 1 for a in accepted_lens) / len(accepted_lens) if accepted_lens else 0.0


def acceptance_rate(accepted_tokens: int, drafted_tokens: int) -> float:
    """Accepted draft tokens / drafted tokens; 0 when nothing was drafted."""
    return accepted_tokens / drafted_tokens if drafted_tokens else 0.0


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    """Throughput ratio against a baseline measured in the same run."""
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s else 0.0


@dataclass
class StepRecord:
    """One verification step of a batch. Lists are per row."""

    step: int
    active: list[bool]
    drafted: list[int]
    """draft tokens verified per row"""
    accepted_len: list[int]
    committed: list[int]
    """tokens appended to the output this step (accepted + bonus, after EOS/max-token cuts)"""
    relaxed: list[int]
    strict_fallbacks: list[int]
    tree_depth: int
    draft_s: float
    verify_s: float
    drafted_by_depth: list[list[int]]
    """per row: drafted nodes at depth 1, 2, ..."""
    accepted_depth: list[int]
    """per row: depth of the deepest accepted node (= accepted_len)"""
    prompt_index: list[int] = field(default_factory=list)
    """per row: which prompt of the call the row was decoding"""
    accepted_nodes: list[list[int]] = field(default_factory=list)
    """per row: the verified tree's node indices on the accepted path, root excluded (policies
    that learn from verdicts pair them with the tree they drafted)"""
    tree_parents: list[list[int]] = field(default_factory=list)
    """per row: each verified node's parent (-1 for the root and padding), read with the verdict,
    so policies that learn from the tree's shape need no read of their own"""
    step_s: float = 0.0
    """wall time of the step from the start of drafting to this record: draft, verification,
    cache commits and bookkeeping (the policy's feedback comes after it); 0 when unmeasured"""
    graph_captures: int = 0
    """CUDA graphs the target and draft runners captured during the step: their capture time
    is in the step's times, which then say nothing of a typical step (policies that learn from
    the wall clock skip it); 0 once every shape the decode meets is captured"""
    admit_s: float = 0.0
    """time spent admitting prompts (their prefill and first token) since the previous step's
    record: the first batch's prefill before step 0, in a rolling batch also the prompts that
    took finished rows' places"""


@dataclass
class GenerationStats:
    """Counters of one generated sequence; derived metrics are properties."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    """verification steps (the first token, chosen at prefill, is not a step)"""
    accepted_tokens: int = 0
    drafted_tokens: int = 0
    relaxed_tokens: int = 0
    strict_fallbacks: int = 0
    wall_s: float = 0.0
    """from this prompt's admission into the batch to its last token"""
    queue_s: float = 0.0
    """time the prompt waited for a free batch row before its prefill"""
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    forward_s: float | None = 0.0
    """time inside model forwards (target and draft); None when they were not timed (CUDA by
    default: `specdec.models.runner.forward_timing_default`)"""
    accepted_lens: list[int] = field(default_factory=list)
    root_only_steps: int = 0
    """verification steps in which the row's tree was its root alone, nothing drafted (CAST's plain
    steps, a row's last token, a tree a policy cut to the root); tau counts each as one token"""
    drafted_by_depth: list[int] = field(default_factory=list)
    """drafted nodes per tree depth (index 0 = depth 1), summed over steps"""
    accepted_by_depth: list[int] = field(default_factory=list)
    """accepted nodes per tree depth, summed over steps"""

    @property
    def tau(self) -> float:
        return tau(self.accepted_lens)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted_tokens, self.drafted_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        return (self.wall_s - self.ttft_s) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def overhead_s(self) -> float:
        """Wall time outside prefill, drafting and verification (sampling, bookkeeping)."""
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def engine_efficiency(self) -> float | None:
        """share of wall time inside model forwards; None when forwards were not timed"""
        if self.forward_s is None:
            return None
        return self.forward_s / self.wall_s if self.wall_s > 0 else 0.0

    def add_step(self, record: StepRecord, row: int) -> None:
        self.steps += 1
        self.drafted_tokens += record.drafted[row]
        self.accepted_tokens += record.accepted_len[row]
        self.relaxed_tokens += record.relaxed[row]
        self.strict_fallbacks += record.strict_fallbacks[row]
        self.accepted_lens.append(record.accepted_len[row])
        self.root_only_steps += record.drafted[row] == 0
        by_depth = record.drafted_by_depth[row]
        while len(self.drafted_by_depth) < len(by_depth):
            self.drafted_by_depth.append(0)
            self.accepted_by_depth.append(0)
        for d, count in enumerate(by_depth):
            self.drafted_by_depth[d] += count
        for d in range(record.accepted_len[row]):
            self.accepted_by_depth[d] += 1

    def summary(self) -> dict:
        """The headline figures (`specdec generate --json` prints tau, acceptance_rate, tokens_per_s, steps, ttft_ms, tpot_ms)."""
        return {
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_s": self.tokens_per_s,
            "steps": self.steps,
            "ttft_ms": self.ttft_s * 1e3,
            "tpot_ms": self.tpot_s * 1e3,
            "new_tokens": self.new_tokens,
            "accepted_tokens": self.accepted_tokens,
            "drafted_tokens": self.drafted_tokens,
            "relaxed_tokens": self.relaxed_tokens,
            "strict_fallbacks": self.strict_fallbacks,
            "draft_ms": self.draft_s * 1e3,
            "verify_ms": self.verify_s * 1e3,
            "engine_efficiency": self.engine_efficiency,
        }

    def to_dict(self) -> dict:
        return {**asdict(self), **self.summary()}


def upper_bound_speedup(tau_max: float, ar_token_s: float, draft_step_s: float, verify_step_s: float) -> float:
    """Speedup over AR if every drafted path were accepted fully.

    ub = tau_max * t_AR / (t_draft + t_verify), where
    - tau_max: tokens a step would commit with its deepest path accepted (tree depth + 1),
      averaged over the method's steps;
    - ar_token_s: AR's measured time per token (one AR decode step: its draft + verify time);
    - draft_step_s, verify_step_s: the method's measured time per step drafting and verifying.
    Prefill and per-step bookkeeping are left out on both sides. 0 when a cost is missing.
    """
    step_s = draft_step_s + verify_step_s
    return tau_max * ar_token_s / step_s if step_s > 0 and ar_token_s > 0 else 0.0


def batch_stats(rows: Sequence[GenerationStats], wall_s: float | None = None, steps: Sequence[StepRecord] | None = None) -> GenerationStats:
    """One `GenerationStats` for a call that decoded `rows` together: counters and step lists summed.

    - wall_s: the call's wall time, measured around it (default: the longest any row took,
      queueing included); tokens/s is then the batch's summed throughput and TPOT is per
      summed token;
    - TTFT: the longest any row waited for its first token (queueing + its own TTFT);
    - prefill, drafting and verification time: the longest any row saw (rows admitted
      together share one prefill; each sees every step from its admission to its end, so
      when all start together the longest-lived row saw every step);
    - forward time: the call's (every row carries the same total);
    - steps: the call's step records (`keep_steps`); when given, the step count, the prefill
      (admission) time and the drafting and verification time are the call's, summed over them.
      Give them for a rolling call (more prompts than rows), where no row saw every step and
      prompts were prefilled as rows came free.
    One row gives that row's own figures (with the call's wall time when given).
    """
    if not rows:
        return GenerationStats()
    out = GenerationStats(
        prompt_tokens=sum(r.prompt_tokens for r in rows),
        new_tokens=sum(r.new_tokens for r in rows),
        steps=max(r.steps for r in rows),
        accepted_tokens=sum(r.accepted_tokens for r in rows),
        drafted_tokens=sum(r.drafted_tokens for r in rows),
        relaxed_tokens=sum(r.relaxed_tokens for r in rows),
        strict_fallbacks=sum(r.strict_fallbacks for r in rows),
        wall_s=wall_s if wall_s is not None else max(r.queue_s + r.wall_s for r in rows),
        ttft_s=max(r.queue_s + r.ttft_s for r in rows),
        prefill_s=max(r.prefill_s for r in rows),
        draft_s=max(r.draft_s for r in rows),
        verify_s=max(r.verify_s for r in rows),
        forward_s=rows[0].forward_s,
        accepted_lens=[a for r in rows for a in r.accepted_lens],
        root_only_steps=sum(r.root_only_steps for r in rows),
    )
    if steps:
        out.steps = len(steps)
        out.draft_s = sum(s.draft_s for s in steps)
        out.verify_s = sum(s.verify_s for s in steps)
        out.prefill_s = sum(s.admit_s for s in steps)
    depth = max(len(r.drafted_by_depth) for r in rows)
    out.drafted_by_depth = [sum(r.drafted_by_depth[d] for r in rows if d < len(r.drafted_by_depth)) for d in range(depth)]
    out.accepted_by_depth = [sum(r.accepted_by_depth[d] for r in rows if d < len(r.accepted_by_depth)) for d in range(depth)]
    return out


# ----- quality figures (lossy accept rules) -------------------------------------------


def common_prefix_len(output: Sequence[int], reference: Sequence[int]) -> int:
    """Tokens equal to `reference` at the same position before the first divergence."""
    n = 0
    for a, b in zip(output, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


def _pooled(counts: Sequence[int], outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    total = sum(max(len(o), len(r)) for o, r in zip(outputs, references, strict=True))
    return sum(counts) / total if total else 1.0


def prefix_agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """AR prefix agreement (the MARS paper's "precision"), pooled over completions.

    sum of `common_prefix_len(output, reference)` / sum of max(len(output), len(reference)):
    1 iff every output equals its reference; 1 when there are no tokens at all.
    Example: output [5, 6, 7, 8], reference [5, 6, 9, 8] -> 2 / 4 = 0.5.
    """
    return _pooled([common_prefix_len(o, r) for o, r in zip(outputs, references, strict=True)], outputs, references)


def position_agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """AR token agreement, pooled: tokens equal to the reference at the same position (anywhere,
    also after a divergence) / sum of max(len(output), len(reference)).

    Example: output [5, 6, 7, 8], reference [5, 6, 9, 8] -> 3 / 4 = 0.75.
    """
    same = [sum(a == b for a, b in zip(o, r, strict=False)) for o, r in zip(outputs, references, strict=True)]
    return _pooled(same, outputs, references)


def exact_match_share(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Share of completions identical to their reference (token for token); 1 when there are none."""
    pairs = list(zip(outputs, references, strict=True))
    return sum(list(o) == list(r) for o, r in pairs) / len(pairs) if pairs else 1.0


def mean_nll(token_logprobs: Sequence[float]) -> float:
    """Mean negative log-likelihood in nats per token: -mean(log p(token | prefix)); 0 without tokens.

    Pool several completions by concatenating their token log-probabilities (a token-weighted mean).
    """
    return -math.fsum(token_logprobs) / len(token_logprobs) if token_logprobs else 0.0


def relaxed_share(relaxed_tokens: int, accepted_tokens: int) -> float:
    """Accepted draft tokens that a lossy rule accepted by relaxation / all accepted draft tokens; 0 when none."""
    return relaxed_tokens / accepted_tokens if accepted_tokens else 0.0


def complete_lines(text: str) -> str:
    """`text` up to and including its last newline (a trailing partial line is dropped)."""
    cut = text.rfind("\n")
    return text[: cut + 1] if cut >= 0 else ""


def has_code(text: str) -> bool:
    """Whether `text` holds a line that is neither blank nor a `#` comment."""
    return any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines())


def code_parses(prompt: str, completion: str, finished: bool = False) -> bool:
    """Whether prompt + completion is valid Python (`ast.parse`) and the completion adds code.

    Unless the completion `finished` (ended by EOS), the text is first cut at its last
    complete line, so a completion stopped mid-line by the token limit is not held against
    it; a block header left without its body, an unclosed bracket or string still fails.
    The part of the completion that is kept must hold code (`has_code`): a completion of
    blank lines and comments only, or one cut away entirely, does not count as parsing code.
    """
    text = prompt + completion
    source = text if finished else complete_lines(text)
    if not has_code(source[len(prompt) :]):
        return False
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: null bytes in the source
        return False
    return True


def parse_share(parsed: Sequence[bool]) -> float | None:
    """Share of code completions that parse; None when there is no code completion."""
    return sum(parsed) / len(parsed) if parsed else None


LOOP_MAX_PERIOD = 4
"""longest repeating unit, in tokens, that counts as a short loop (`ends_in_loop`)"""


def ends_in_loop(tokens: Sequence[int], max_period: int = LOOP_MAX_PERIOD) -> bool:
    """Whether the last half of `tokens` is one unit of at most `max_period` tokens repeated.

    The last ceil(n/2) tokens must have a period p <= max_period (each equals the token p
    before it) and hold at least two whole units (2p <= ceil(n/2)). Examples:
    [5, 6, 1, 2, 1, 2, 1, 2] -> True (p = 2 over the last 4); [9, 8, 7, 7, 7] -> True (p = 1
    over the last 3); [1, 2, 3, 4, 5, 6] -> False; [7, 7] -> False (one token of half: too
    short to show a repeat).
    """
    n = len(tokens)
    half = (n + 1) // 2
    start = n - half
    for period in range(1, max_period + 1):
        if 2 * period > half:
            break
        if all(tokens[i] == tokens[i - period] for i in range(start + period, n)):
            return True
    return False


def loop_share(flags: Sequence[bool]) -> float | None:
    """Share of completions that end in a short loop (`ends_in_loop`); None without completions."""
    return sum(flags) / len(flags) if flags else None
