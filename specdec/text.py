"""Prompts from chat messages, and completion text from committed tokens (with stop strings).

Shared by the server (`specdec.serve`), `specdec generate --chat/--stop`, the Python API
(`SpeculativeDecoder.generate(messages=..., stop=...)`) and `specdec bench --chat`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PLAIN_CHAT_TEMPLATE = "one line per message, `<role>: <content>\\n`, then `assistant:`"
"""how chat messages become a prompt when the tokenizer has no chat template (server only)"""

Message: TypeAlias = "Mapping[str, Any] | tuple[str, str]"
"""one chat message: {"role": ..., "content": ...} or (role, content)"""

ROLES = ("system", "user", "assistant", "tool")


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (instruct checkpoints do; base models usually not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(tokenizer: Any, model: str | None = None, flag: str = "--chat") -> None:
    """A one-line SpecDecError, naming the model and what to do, when the tokenizer has no chat template."""
    if has_chat_template(tokenizer):
        return
    name = model or getattr(tokenizer, "name_or_path", None) or "the target"
    raise SpecDecError(
        f"{flag} needs a chat template, and the tokenizer of {name!r} has none (a base model, not an instruct/chat checkpoint); "
        "use the model's instruct checkpoint (e.g. Qwen/Qwen2.5-7B-Instruct), add a Jinja \"chat_template\" to its tokenizer_config.json "
        f"(API: set tokenizer.chat_template), or drop {flag} and give the raw text to continue"
    )


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone UTF-16 surrogate in `text` (e.g. "\\ud800", from text decoded
    with errors='surrogateescape' or a JSON escape), which no tokenizer or UTF-8 encoder takes;
    None when there is none."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def check_utf8(text: str, where: str) -> None:
    """A SpecDecError naming `where` when `text` holds a lone UTF-16 surrogate (`lone_surrogate`)."""
    at = lone_surrogate(text)
    if at is not None:
        raise SpecDecError(
            f"{where} holds a lone UTF-16 surrogate {text[at]!r} at character {at}, which no tokenizer takes; "
            "remove it, or decode the text's bytes as UTF-8 without errors='surrogateescape'"
        )


def message_pairs(messages: Sequence[Message], system: str | None = None, where: str = "messages") -> list[tuple[str, str]]:
    """(role, content) pairs of `messages` (dicts with role and content, or pairs), with a
    `system` message first when given; a SpecDecError names a malformed message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise SpecDecError(f"{where} must be a list of messages such as {{'role': 'user', 'content': 'Hi'}}, got {type(messages).__name__}")
    pairs: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        elif isinstance(message, tuple | list) and len(message) == 2:
            role, content = message
        else:
            raise SpecDecError(f"{where}[{i}] must be {{'role': ..., 'content': ...}} or a (role, content) pair, got {message!r}")
        if role not in ROLES:
            raise SpecDecError(f"{where}[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise SpecDecError(f"{where}[{i}] content must be a string, got {type(content).__name__}")
        check_utf8(content, f"{where}[{i}] content")
        pairs.append((role, content))
    if not pairs:
        raise SpecDecError(f"{where} is empty; give at least one message, e.g. {{'role': 'user', 'content': 'Hi'}}")
    if system is not None:
        if pairs[0][0] == "system":
            raise SpecDecError(f"{where} already starts with a system message; give the system prompt once (drop system= / --system, or that message)")
        pairs.insert(0, ("system", system))
    return pairs


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]], plain_fallback: bool = True) -> tuple[str, bool]:
    """The prompt text for (role, content) messages and whether it came from the tokenizer's
    own chat template (its text then already holds any special tokens it needs).

    With a `tokenizer.chat_template`: that template, with the generation prompt added.
    Without: the plain template, e.g. "system: Be brief.\\nuser: Hi\\nassistant:" (the
    server's behaviour), or with plain_fallback=False the error of `check_chat_template`.
    """
    if has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": role, "content": content} for role, content in messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # jinja2 errors of the model's own template (e.g. "roles must alternate")
            raise SpecDecError(f"the model's chat template rejected the messages: {err}") from err
        if not isinstance(text, str):
            raise SpecDecError("the model's chat template did not render to text")
        return text, True
    if not plain_fallback:
        check_chat_template(tokenizer)
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:", False


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str]], plain_fallback: bool = False) -> list[int]:
    """Token ids of the chat prompt of `messages`: the template's text is tokenized without
    adding special tokens (it holds them itself), as `apply_chat_template(tokenize=True)` does."""
    text, templated = chat_prompt(tokenizer, messages, plain_fallback=plain_fallback)
    if templated:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


class CompletionText:
    """Turns a request's committed tokens into text deltas, cut at the first stop string.

    Text is released only when it is final: a trailing U+FFFD (an incomplete UTF-8 sequence)
    or a tail that could be the start of a stop string is held back until the next tokens
    decide it. `text` is the completion so far, `tokenizer.decode(tokens, skip_special_tokens=True)`;
    with `stop_strings` it is cut before the first one found and `stopped` becomes True, and
    `token_count` counts only the tokens needed to produce the text up to it (a speculative
    step may commit several tokens past a stop string; how many depends on the method, so
    usage must not count them).

    Decoding is incremental (as in HF text-generation-inference and vLLM), so a step costs
    the tokens it added, not the whole completion. A *stable point* is a token index where
    the decoded text ended in a complete character; the text before it is never decoded
    again. Each `add` decodes a window from the stable point before the last one, and the
    new text is the window's text past that of its first part. E.g. with stable points 4
    and 7, adding t10 decodes t4..t10 and t4..t6: decoders that treat a sequence's first
    token specially (SentencePiece drops its leading space) see the same first token in
    both, and the difference is the text of t7..t10 as a full decode gives it.

    A decoder for which this does not hold (a later token rewrites earlier text, e.g. a
    stray UTF-8 continuation byte after byte-fallback tokens turns them all into U+FFFD) is
    noticed when a window's text stops extending its first part, or at the end by one full
    decode; from then on the request's text is decoded in full each step, as a full decode
    gives it (what was already released cannot be taken back).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self.token_ids: list[int] = []
        self.sent = 0
        """characters of `text` already released as deltas"""
        self.stopped = False
        self._stop_tokens: int | None = None
        self._deltas: list[str] = []
        """the text released so far, `text[:sent]`, in pieces"""
        self._window = ""
        """`text[_from:]`: the text not released yet, with what stop strings and the stable point still need before it"""
        self._from = 0
        self._window_start = 0
        """token index where the next decode window starts (the stable point before the last one)"""
        self._stable = 0
        """token index of the last stable point"""
        self._stable_chars = 0
        """len(text) at the last stable point"""
        self._incremental = True
        """False once a full decode is needed (see the class docstring)"""

    @property
    def text(self) -> str:
        """The decoded completion so far, cut at a stop string."""
        if not self._incremental:
            return self._window  # _from is 0: the whole text
        return "".join(self._deltas) + self._window[self.sent - self._from :]

    @property
    def pending(self) -> int:
        """Characters of `text` decoded but not released yet (held back; 0 when every token's text is out)."""
        return self._from + len(self._window) - self.sent

    @property
    def token_count(self) -> int:
        """Completion tokens: all added tokens, or after a stop string the fewest that decode
        to the text before it."""
        return len(self.token_ids) if self._stop_tokens is None else self._stop_tokens

    def add(self, tokens: Sequence[int]) -> str:
        """Append newly committed tokens; returns the text that became final (maybe "")."""
        if self.stopped or not tokens:
            return ""
        self.token_ids.extend(tokens)
        if self._incremental:
            self._decode_window()
        else:
            self._window = self._decode(self.token_ids)
        cut = self._first_stop()
        if cut is not None and self._incremental and not self._matches_full_decode():
            cut = self._first_stop()
        if cut is not None:
            self._window = self._window[: cut - self._from]
            self.stopped = True
            count = len(self.token_ids)  # drop the tokens the cut text does not need (at most one step's)
            text = self.text
            while count > 0 and self._decode(self.token_ids[: count - 1]).startswith(text):
                count -= 1
            self._stop_tokens = count
            return self._release(cut)
        return self._release(self._from + len(self._window) - self._held_back())

    def finish(self) -> str:
        """The rest of the text (nothing more will come)."""
        if self.stopped:
            return ""
        if self._incremental:
            self._matches_full_decode()
        return self._release(self._from + len(self._window))

    # ----- decoding --------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _decode_window(self) -> None:
        """Decode the tokens past the last stable point (and move it when they end in a complete character)."""
        ids = self.token_ids
        known = self._decode(ids[self._window_start : self._stable])
        window = self._decode(ids[self._window_start :])
        if not window.startswith(known):
            self._decode_in_full()
            return
        tail = window[len(known) :]  # the text of the tokens past the stable point
        self._window = self._window[: self._stable_chars - self._from] + tail
        if tail and not tail.endswith("\ufffd"):
            self._window_start, self._stable = self._stable, len(ids)
            self._stable_chars += len(tail)

    def _matches_full_decode(self) -> bool:
        """Check the text against one full decode; on a difference, switch to full decodes."""
        if self._decode(self.token_ids) == self.text:
            return True
        self._decode_in_full()
        return False

    def _decode_in_full(self) -> None:
        self._incremental = False
        self._from = 0
        self._window = self._decode(self.token_ids)

    # ----- releasing -------------------------------------------------------------------
    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self._window[self.sent - self._from : upto - self._from]
        self.sent = upto
        self._deltas.append(delta)
        if self._incremental:  # keep only what stop strings and the stable point still need
            start = min(max(0, self.sent - self._longest_stop), self._stable_chars)
            self._window = self._window[start - self._from :]
            self._from = start
        return delta

    def _search_start(self) -> int:
        # a stop string can only appear where new text (or the held-back tail) is
        return max(0, self.sent - self._longest_stop)

    def _first_stop(self) -> int | None:
        """Where the first stop string starts in `text`, if one is there."""
        start = self._search_start()
        recent = self._window[start - self._from :]
        hits = [i for i in (recent.find(s) for s in self.stop_strings) if i >= 0]
        return start + min(hits) if hits else None

    def _held_back(self) -> int:
        """Characters at the end of `text` not yet final."""
        recent = self._window[self._search_start() - self._from :]
        text = recent.rstrip("\ufffd")  # an incomplete UTF-8 sequence is not final
        incomplete = len(recent) - len(text)
        longest = 0  # nor is a tail before it that could start a stop string
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return incomplete + longest
