"""Prompts from chat messages, and completion text from committed tokens (with stop strings)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdec.errors import SpecDecError

PLAIN_CHAT_TEMPLATE = "one line per message, `<role>: <content>\\n`, then `assistant:`"
"""how chat messages become a prompt when the tokenizer has no chat template"""


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]]) -> tuple[str, bool]:
    """The prompt text for (role, content) messages and whether it came from the tokenizer's
    own chat template (its text then already holds any special tokens it needs).

    With a `tokenizer.chat_template`: that template, with the generation prompt added.
    Without: the plain template, e.g. "system: Be brief.\\nuser: Hi\\nassistant:".
    """
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": role, "content": content} for role, content in messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # jinja2 errors of the model's own template (e.g. "roles must alternate")
            raise SpecDecError(f"the model's chat template rejected the messages: {err}") from err
        if not isinstance(text, str):
            raise SpecDecError("the model's chat template did not render to text")
        return text, True
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:", False


class CompletionText:
    """Turns a request's committed tokens into text deltas, cut at the first stop string.

    Text is decoded from all tokens so far (so multi-token characters come out whole) and
    released only when it is final: a trailing U+FFFD (an incomplete UTF-8 sequence) or a
    tail that could be the start of a stop string is held back until the next tokens
    decide it. `text` is the completion so far; with `stop_strings` the text is cut before
    the first one found and `stopped` becomes True, and `token_count` counts only the tokens
    needed to produce the text up to it (a speculative step may commit several tokens past a
    stop string; how many depends on the method, so usage must not count them).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.token_ids: list[int] = []
        self.text = ""
        """the decoded completion, cut at a stop string"""
        self.sent = 0
        """characters of `text` already released as deltas"""
        self.stopped = False
        self._stop_tokens: int | None = None

    @property
    def token_count(self) -> int:
        """Completion tokens: all added tokens, or after a stop string the fewest that decode
        to the text before it."""
        return len(self.token_ids) if self._stop_tokens is None else self._stop_tokens

    def add(self, tokens: Sequence[int]) -> str:
        """Append newly committed tokens; returns the text that became final (maybe "")."""
        if self.stopped:
            return ""
        self.token_ids.extend(tokens)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            count = len(self.token_ids)  # drop the tokens the cut text does not need (at most one step's)
            while count > 0 and self.tokenizer.decode(self.token_ids[: count - 1], skip_special_tokens=True).startswith(self.text):
                count -= 1
            self._stop_tokens = count
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The rest of the text (nothing more will come)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def _first_stop(self) -> int | None:
        # a stop string can only appear where new text (or the held-back tail) is
        start = max(0, self.sent - max((len(s) for s in self.stop_strings), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Characters at the end of `text` not yet final."""
        text = self.text.rstrip("\ufffd")  # an incomplete UTF-8 sequence is not final
        incomplete = len(self.text) - len(text)
        longest = 0  # nor is a tail before it that could start a stop string
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return incomplete + longest
