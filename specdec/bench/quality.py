"""Output quality of a benchmark's calls (`specdec bench --quality`), for lossy rules such as MARS.

After the timed measurement (never inside it) every generated row is scored:

- its tokens' log-probabilities under the target (one extra target forward over the fed
  context + the completion; raw logits, i.e. temperature 1 without top-k/top-p), from which
  `specdec.stats.mean_nll` makes the NLL;
- for code prompts (`is_code_prompt`), whether prompt + completion parses as Python
  and the completion holds code, not only comments (`specdec.stats.code_parses`);
- for every completion, whether it ends in a short loop (`specdec.stats.ends_in_loop`,
  the degeneracy figure).

Identical (context, completion) pairs, e.g. the repeats of a greedy run, are scored once.
Agreement with AR needs no model and is computed in `specdec.bench.report.summarize`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.bench.prompts import BenchPrompt
from specdec.errors import SpecDecError
from specdec.stats import code_parses, ends_in_loop

CODE_PROMPT_MODES = ("auto", "all", "none")
"""--code-prompts: which prompts count as code (parse share)"""

CODE_LANGUAGES = frozenset({"python", "py"})
"""values of a prompt line's `language` field that mark it as Python code"""


def is_code_prompt(prompt: BenchPrompt, mode: str = "auto") -> bool:
    """Whether `prompt`'s completions are checked with `ast.parse`.

    Only single-turn prompts qualify. mode 'all': every one; 'none': none; 'auto': a prompt
    whose line has `language: python`, an id ending in `.py` (the bundled stdlib-heldout set)
    or an id starting with `HumanEval` (HumanEval-style files).
    """
    if mode not in CODE_PROMPT_MODES:
        raise SpecDecError(f"--code-prompts {mode!r}: choose one of {', '.join(CODE_PROMPT_MODES)}")
    if len(prompt.turns) != 1 or mode == "none":
        return False
    if mode == "all":
        return True
    if prompt.language is not None:
        return prompt.language.lower() in CODE_LANGUAGES
    return prompt.id.endswith(".py") or prompt.id.startswith("HumanEval")


def completion_logprobs(target: PreTrainedModel, context: Sequence[int], completion: Sequence[int]) -> list[float]:
    """log p_target(completion[i] | context + completion[:i]) for every completion token (one forward)."""
    if not completion:
        return []
    if not context:
        raise SpecDecError("cannot score a completion without a context token")
    device = next(target.parameters()).device
    ids = torch.tensor([list(context) + list(completion)], dtype=torch.long, device=device)  # [1, L + n]
    with torch.inference_mode():
        logits = target(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]  # [L + n, V]
    start = len(context) - 1
    logprobs = torch.log_softmax(logits[start : start + len(completion)].float(), dim=-1)  # [n, V]
    tokens = torch.tensor(list(completion), dtype=torch.long, device=device)[:, None]  # [n, 1]
    return logprobs.gather(-1, tokens).squeeze(-1).tolist()


class QualityScorer:
    """Scores completions with the target (cached per (context, completion)) and checks code."""

    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int]) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}

    def logprobs(self, context: Sequence[int], completion: Sequence[int]) -> list[float]:
        key = (tuple(context), tuple(completion))
        if key not in self._cache:
            self._cache[key] = completion_logprobs(self.target, context, completion)
        return self._cache[key]

    def parses(self, prompt_text: str, completion: Sequence[int], finish_reason: str) -> bool:
        """prompt text + decoded completion (EOS dropped) parses, cut at the last complete line unless it ended by EOS."""
        text = self.tokenizer.decode([t for t in completion if t not in self.eos], skip_special_tokens=True)
        return code_parses(prompt_text, text, finished=finish_reason == "eos")

    def loops(self, completion: Sequence[int]) -> bool:
        """The completion (EOS dropped) ends in a short loop: its last half repeats a unit of <= 4 tokens."""
        return ends_in_loop([t for t in completion if t not in self.eos])

    @property
    def scored(self) -> int:
        """distinct (context, completion) pairs scored so far"""
        return len(self._cache)
