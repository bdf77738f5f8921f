"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests forbid unknown fields. Fields of the OpenAI API this server does not implement
(`logprobs`, `echo`, penalties, ...) are declared so that a non-default value gets an error
that names it, rather than being silently ignored. Text must be valid Unicode: JSON can
spell a lone UTF-16 surrogate (`"\\ud800"`), which no tokenizer or UTF-8 encoder takes.

Validators here raise the *reason* only ("must be non-empty; ..."): the app's error handler
(`specdec.serve.app`) puts the field and the value in front of it once (`stop[1]="" must be
non-empty; ...`). A reason about one element of a list field is an `item_error`, which names the
element's index.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from specdec.parsing import SEED_MAX, SEED_MIN
from specdec.text import lone_surrogate

MAX_STOP_STRINGS = 4
"""at most this many stop strings per request (as OpenAI)"""
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "echo", "specdec"})
"""fields for which JSON null means the default value"""
LONE_SURROGATE = "lone_surrogate"
"""the validation error type of a string holding a lone UTF-16 surrogate (its ctx names the field)"""
INVALID_ITEM = "invalid_item"
"""the validation error type of one bad element of a list field (its ctx `index` names the element)"""


def item_error(index: int, reason: str) -> PydanticCustomError:
    """A validation error about element `index` of the field being validated (reported as e.g. stop[1])."""
    return PydanticCustomError(INVALID_ITEM, reason, {"index": index})


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """The first string of a JSON value (object keys included) that holds a lone UTF-16
    surrogate: (its field, e.g. messages[0].content, the character's index, the character)."""
    if isinstance(value, str):
        at = lone_surrogate(value)
        return None if at is None else (path, at, value[at])
    if isinstance(value, dict):
        for key, item in value.items():
            field = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and (bad := find_lone_surrogate(key, path)) is not None:
                return bad
            if (bad := find_lone_surrogate(item, field)) is not None:
                return bad
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (bad := find_lone_surrogate(item, f"{path}[{i}]")) is not None:
                return bad
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecDecOptions(_Strict):
    """The optional `specdec` field: per-request decoding choices (None: the server's)."""

    method: str | None = None
    """a method of `specdec.methods.POLICY_CLASSES` (ar, chain, static, eagle2, dynatree, cast)"""
    verify: str | None = None
    """an accept rule: greedy, sampling, mars, or auto (greedy at temperature 0, sampling above)"""
    mars_theta: float | None = Field(default=None, gt=0)
    """MARS logit-ratio threshold (needs verify "mars")"""
    top_k: StrictInt = Field(default=0, ge=0)
    """sample only from the k most likely tokens (0 = off)"""


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    """send one more chunk before [DONE] with `usage` (and empty `choices`)"""


def _check_stop(value: str | list[str] | None) -> list[str]:
    if isinstance(value, str):
        if not value:
            raise ValueError("must be non-empty; leave the field out for no stop string")
        return [value]
    stops = list(value or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"holds {len(stops)} stop strings; send at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(stops):
        if not stop:
            raise item_error(i, "must be non-empty; remove it")
    return stops


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    """the served model's name (`GET /v1/models`); None: the served model"""
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    """0 to 2**64 - 1, as `SpeculativeDecoder.generate(seed=...)` and `specdec generate --seed`"""
    user: str | None = None
    """accepted and ignored"""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    specdec: SpecDecOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = find_lone_surrogate(data)
        if bad is not None:
            field, index, char = bad
            raise PydanticCustomError(
                LONE_SURROGATE,
                "{where} holds a lone UTF-16 surrogate (\\u{code} at character {index}), which is not valid Unicode; "
                "send the character itself, or both halves of its surrogate pair (e.g. \\ud83d\\ude00)",
                {"param": field, "where": field or "a field name", "code": f"{ord(char):04x}", "index": index},
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"temperature": null` and the like mean the default (some clients send nulls)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _number_not_bool(cls, value: Any) -> Any:
        """JSON true/false is not a number (pydantic's lax mode would read true as 1.0)."""
        if isinstance(value, bool):
            raise ValueError("is a boolean; give a number")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n < 1:
            raise ValueError("must be 1: specdec returns one choice per request")
        if n > 1:
            raise ValueError(f"is not supported: this server returns one choice per request; send {n} requests (with different seeds) instead")
        return n

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int | None) -> int | None:
        """The range and wording of `specdec.parsing.check_seed` (the CLI's and the Python API's)."""
        if seed is not None and seed < SEED_MIN:
            raise ValueError(f"must be at least {SEED_MIN}; give an integer from {SEED_MIN} to {SEED_MAX}")
        if seed is not None and seed > SEED_MAX:
            raise ValueError(f"does not fit in 64 bits; give an integer from {SEED_MIN} to {SEED_MAX}")
        return seed

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        _check_stop(value)
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0, 0.0):
            raise ValueError("is not supported (this server applies no penalties); leave the field out or send 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("is not supported; leave the field out")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return _check_stop(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions"""

    prompt: str | list[str]
    """one string (a list holding exactly one string is accepted too)"""
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"holds {len(value)} prompts; one prompt per request is supported, send one request per prompt")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("is not supported; leave it out (the response holds the completion only)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("is not supported; leave the field out")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("is not supported; leave it out or send 1")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("is not supported (no insertion); leave the field out")
        return value

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions"""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    """the newer name of max_tokens"""
    logprobs: StrictBool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("is not supported; leave the field out or send false")
        return value

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError(
                f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} disagree; send one of them"
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


class DecodingReport(BaseModel):
    """The `specdec` field of a response: how it was decoded (figures as in `specdec.stats`)."""

    method: str
    verify: str
    tau: float
    acceptance_rate: float
    steps: int
    queue_ms: float
    ttft_ms: float
    tpot_ms: float


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    specdec: DecodingReport | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specdec: DecodingReport | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


def dump(model: BaseModel) -> dict[str, Any]:
    """A response body as JSON-ready dict (None fields kept: OpenAI sends them as null)."""
    return model.model_dump(mode="json")
