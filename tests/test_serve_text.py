"""`specdec.serve.text.CompletionText`: incremental detokenization with stop strings, checked
against a plain reference that decodes every token at every step."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from specdec.serve.text import CompletionText
from specdec.training.tokenizer import train_tokenizer


class FullDecodeText:
    """The reference: `CompletionText` as it was before incremental decoding (every step
    decodes all tokens). Same contract: deltas, `text`, `stopped`, `token_count`."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._stop_tokens: int | None = None

    @property
    def token_count(self) -> int:
        return len(self.token_ids) if self._stop_tokens is None else self._stop_tokens

    def add(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(tokens)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        start = max(0, self.sent - max((len(s) for s in self.stop_strings), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            count = len(self.token_ids)
            while count > 0 and self.tokenizer.decode(self.token_ids[: count - 1], skip_special_tokens=True).startswith(self.text):
                count -= 1
            self._stop_tokens = count
            return self._release(len(self.text))
        stripped = self.text.rstrip("\ufffd")
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(stripped)), longest, -1):
                if stripped.endswith(stop[:n]):
                    longest = n
                    break
        return self._release(len(self.text) - (len(self.text) - len(stripped)) - longest)

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta


class _CharTokenizer:
    """Each token id is one character (ord)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class _CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


MULTILINGUAL = [
    "def café(naïve):\n    return 'crème brûlée'\n",
    "日本語のテキスト、中文文本。\n",
    "emoji 😀🎉 and ñ, ü, ø, ß; Ελληνικά, русский.\n",
    "for i in range(10):\n    print(i)  # ümlaut\n",
]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style, the tiny pair's kind) trained on multilingual text: merges
    inside multi-byte characters, and random ids produce partial and invalid UTF-8."""
    return train_tokenizer(MULTILINGUAL * 20, Path(tmp_path_factory.mktemp("bytelevel")), vocab_size=400, min_frequency=1)


def make_sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama-2 style: Metaspace pieces, byte fallback (<0xNN> tokens) and a decoder that drops the
    first leading space. A stray continuation byte after byte tokens rewrites earlier text."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdeéü日本", "▁a", "▁ab", "ab", "▁é", "日本"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "a"), ("▁a", "b"), ("a", "b"), ("▁", "é"), ("日", "本")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sentencepiece_like() -> PreTrainedTokenizerFast:
    return make_sentencepiece_like()


def _random_case(rng: random.Random, tokenizer: Any, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """Random steps of random token ids (specials included), and 0-2 stop strings: pieces of the
    decoded text (so that they occur, possibly across steps or inside multi-byte text) or not."""
    ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 60))]
    steps, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        steps.append(ids[i : i + n])
        i += n
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(rng.choice([0, 0, 1, 2])):
        if full and rng.random() < 0.8:
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 4)])
        else:
            stops.append(rng.choice(["é", "日本", "\n", "zzz", "Eé"]))
    return steps, stops


def _run(text: Any, steps: list[list[int]]) -> list[str]:
    return [text.add(step) for step in steps] + [text.finish()]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_incremental_text_equals_the_full_decode(kind, request):
    """Over random token streams: every delta, the text, the stop and the token count equal the
    reference that decodes all tokens every step; without a stop string the text is the full decode."""
    tokenizer = request.getfixturevalue(kind)
    rng = random.Random(0)
    stopped = multibyte = 0
    for _ in range(400):
        steps, stops = _random_case(rng, tokenizer, len(tokenizer))
        fast, reference = CompletionText(tokenizer, stops), FullDecodeText(tokenizer, stops)
        deltas = _run(fast, steps)
        assert deltas == _run(reference, steps), (steps, stops)
        assert (fast.text, fast.stopped, fast.token_count) == (reference.text, reference.stopped, reference.token_count)
        full = tokenizer.decode([t for step in steps for t in step], skip_special_tokens=True)
        if not fast.stopped:
            assert fast.text == full
        else:
            assert full.startswith(fast.text)
        stopped += fast.stopped
        multibyte += any(ord(c) > 0x7F for c in full)
    assert stopped > 50 and multibyte > 100  # the cases did exercise both


def test_byte_level_streams_concatenate_to_the_text(byte_level):
    """A byte-level decode is prefix-stable at character boundaries: the streamed deltas are the text."""
    rng = random.Random(1)
    for _ in range(200):
        steps, stops = _random_case(rng, byte_level, len(byte_level))
        text = CompletionText(byte_level, stops)
        assert "".join(_run(text, steps)) == text.text


def test_a_rewritten_prefix_switches_to_full_decoding(sentencepiece_like):
    """Byte tokens C3 A9 are "é"; a stray continuation byte after them makes the byte-fallback
    decoder turn all three into U+FFFD. The text follows the full decode from then on."""
    byte = {b: sentencepiece_like.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0x80)}
    a = sentencepiece_like.convert_tokens_to_ids("▁a")
    text = CompletionText(sentencepiece_like)
    assert text.add([a, byte[0xC3], byte[0xA9]]) == "aé"
    assert text.add([byte[0x80]]) == ""  # the text is now "a\ufffd\ufffd\ufffd": all of it U+FFFD past "a"
    assert text.finish() == "\ufffd\ufffd" and text.text == "a\ufffd\ufffd\ufffd" == sentencepiece_like.decode([a, byte[0xC3], byte[0xA9], byte[0x80]])


def test_decoding_work_grows_linearly(byte_level):
    """4000 tokens one per step: the tokens decoded stay a small multiple of the tokens added
    (a full decode every step would decode 4000 * 4001 / 2)."""
    rng = random.Random(2)
    printable = [i for i in range(len(byte_level)) if byte_level.decode([i]).isprintable() and byte_level.decode([i])]
    counting = _CountingTokenizer(byte_level)
    text = CompletionText(counting, ["never there"])
    ids = [rng.choice(printable) for _ in range(4000)]
    for tok in ids:
        text.add([tok])
    text.finish()
    assert text.text == byte_level.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 12 * len(ids), counting.decoded  # the final check is one full decode


def test_completion_text_holds_back_possible_stop_strings():
    text = CompletionText(_CharTokenizer(), ["END"])
    out = [text.add([ord(c)]) for c in "abcEN"]
    assert "".join(out) == "abc" and text.text == "abcEN"  # "EN" may start "END": held back
    assert text.add([ord("X")]) == "ENX"  # it did not
    assert text.add([ord(c) for c in "yEND tail"]) == "y" and text.stopped and text.text == "abcENXy"
    assert text.add([ord("z")]) == "" and text.finish() == ""
    plain = CompletionText(_CharTokenizer())
    assert plain.add([ord("a"), 0xFFFD]) == "a" and plain.finish() == "\ufffd"  # a trailing U+FFFD waits for the next token
    # a possible stop-string start before an incomplete character is held back too
    accented = CompletionText(_CharTokenizer(), ["Eé"])
    assert accented.add([ord(c) for c in "abcE"] + [0xFFFD]) == "abc"
    assert accented.add([ord("x")]) == "E\ufffdx"  # the character was not the stop string's é


def test_completion_tokens_stop_at_the_stop_string():
    """A speculative step can commit tokens past a stop string; usage counts only those the text
    before it needs, so it does not depend on the method."""
    text = CompletionText(_CharTokenizer(), ["END"])
    text.add([ord(c) for c in "abcEN"])
    text.add([ord(c) for c in "D and more"])  # one step: the rest of the stop string and 7 more tokens
    assert text.stopped and text.text == "abc" and text.token_count == 3
    assert CompletionText(_CharTokenizer(), ["x"]).token_count == 0
    running = CompletionText(_CharTokenizer(), ["x"])
    running.add([ord("a"), ord("b")])
    assert running.token_count == 2 and not running.stopped
