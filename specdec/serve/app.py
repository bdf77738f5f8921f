"""The FastAPI app: OpenAI-compatible completions and chat completions over a `SpeculativeDecoder`.

`create_app(decoder)` builds it; its lifespan starts and stops the decode worker
(`specdec.serve.scheduler.Scheduler`). Handlers validate the request, check the prompt's size,
tokenize it in a thread (never on the event loop), submit a `Job`, and await its events: a
JSON response, or server-sent events (`data: {...}` chunks, then `data: [DONE]`). A client
that closes its connection cancels its job at once. Every error, and every response's count in
`/metrics`, goes through one middleware (`_Guard`), so every error answers in OpenAI's format
(`specdec.serve.errors`), unexpected ones included.

`app.state.drain(grace_s)` stops the app taking requests and answers every request in flight:
`specdec.serve.server` calls it when the server is told to stop, before connections close.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.api import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.serve.errors import CLIENT_CLOSED_REQUEST, APIError
from specdec.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specdec.serve.metrics import ServerMetrics
from specdec.serve.scheduler import (
    Failed,
    Finished,
    Job,
    LaneKey,
    QueueFullError,
    Scheduler,
    SchedulerStoppedError,
    TextDelta,
    resolve_lane,
    shutting_down,
)
from specdec.serve.schemas import (
    INVALID_ITEM,
    LONE_SURROGATE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DecodingReport,
    ModelCard,
    ModelList,
    Usage,
    dump,
    new_id,
    now,
)
from specdec.text import chat_prompt

log = logging.getLogger("specdec.serve")
T = TypeVar("T")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""max_tokens of a /v1/completions request that gives none (OpenAI's default)"""
CHAT_DEFAULT_MAX_TOKENS = 512
"""max_tokens of a chat request that gives none, when the model's context length is unknown
(otherwise: the rest of the context, as OpenAI)"""
MAX_BODY_BYTES = 4 * 2**20
"""request bodies larger than this get 413, whether announced (Content-Length) or streamed (chunked)"""
CHARS_PER_TOKEN_MARGIN = 2
"""a prompt of more than context x (longest vocabulary entry) x this many characters cannot fit in
the context (a token covers at most its entry's characters; the margin allows for normalizers that
merge characters): it is rejected without tokenizing"""
TOKENIZER_THREADS = 1
"""threads that tokenize prompts (and render chat templates) off the event loop; one keeps
concurrent calls off a single fast tokenizer"""
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def default_model_name(decoder: SpeculativeDecoder) -> str:
    """The target's name: its hub id, or its folder name ("specdec-bundled" for the bundled pair)."""
    from specdec.models.loading import bundled_target

    name = str(getattr(decoder.target, "name_or_path", "") or getattr(decoder.target.config, "_name_or_path", "") or "")
    if not name:
        return "specdec"
    path = Path(name)
    if path.exists():
        if path.resolve() == Path(bundled_target()).resolve():
            return "specdec-bundled"
        return path.name
    return name


class _BodyTooLarge(StarletteHTTPException):
    """Raised while reading a body that has grown past MAX_BODY_BYTES (FastAPI lets HTTP
    exceptions from the body read through to the app's exception handlers)."""

    def __init__(self, size: int, streamed: bool) -> None:
        so_far = " so far" if streamed else ""
        super().__init__(413, f"the request body has {size} bytes{so_far}, more than the {MAX_BODY_BYTES} this server takes; send a shorter prompt")


class _Guard:
    """ASGI middleware around the app: counts every response by endpoint and status code
    (streams, 413s, 500s and 503s included), answers 413 to a body over MAX_BODY_BYTES, whether
    announced by Content-Length or found while it streams in, and answers an exception no
    handler caught with an OpenAI-shaped 500 (logged) instead of a plain-text one."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_http(endpoint, int(message["status"]))
            await send(message)

        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            too_large = _BodyTooLarge(int(length), streamed=False)
            await APIError(413, str(too_large.detail)).response()(scope, receive, counting_send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge(received, streamed=True)
            return message

        try:
            await self.app(scope, limited_receive, counting_send)
        except Exception as err:
            if isinstance(err, _BodyTooLarge):
                error = APIError(413, str(err.detail))
            else:
                log.exception("unhandled error answering %s %s", scope.get("method"), path)
                error = APIError(500, f"internal error: {err!r}")
            if not started:  # else the response is under way: the server closes the connection
                await error.response()(scope, receive, counting_send)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


_MISSING = object()

SHOWN_VALUE_CHARS = 60
"""an error message shows at most this many characters of the offending value (its JSON)"""

REASONS: dict[str, str] = {
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "literal_error": "must be {expected}",
}
"""pydantic error type -> the reason a message gives (formatted with the error's ctx)"""


def _located(body: Any, loc: Sequence[str | int], kind: str) -> tuple[list[str | int], Any]:
    """The request field a pydantic error location names, as path parts, and the value there.

    The location is walked through the request body, so union members' tags (stop -> str /
    list[str], a validator's function-after[...]) are dropped and dict keys are kept."""
    path: list[str | int] = []
    value = body
    for i, part in enumerate(loc):
        in_list = isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value)
        if in_list or (isinstance(part, str) and isinstance(value, dict) and part in value):
            path.append(part)
            value = value[part]
        elif kind == "missing" and i == len(loc) - 1 and isinstance(part, str):
            path.append(part)
            value = _MISSING
        # else: a union member's tag, not a place in the body
    if not path:  # no body to walk (not a body error): the parts that look like fields
        path = [p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict", "none"))]
        value = _MISSING
    return path, value


def _param(path: Sequence[str | int]) -> str:
    """Path parts as the request field they name, e.g. messages[0].role or logit_bias["50256"]."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += ("." if out else "") + part
        else:
            out += f"[{json.dumps(part, ensure_ascii=False)}]"
    return out


def _shown(value: Any) -> str:
    """A value as its JSON, shortened to SHOWN_VALUE_CHARS characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 1] + "…"


def _reason(error: Mapping[str, Any]) -> str:
    """What is wrong with the value, without naming the field or the value ("must be at most 2")."""
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind in ("too_short", "too_long") and isinstance(count := ctx.get("min_length" if kind == "too_short" else "max_length"), int):
        return f"must have at {'least' if kind == 'too_short' else 'most'} {count} item{'' if count == 1 else 's'}"
    template = REASONS.get(kind)
    if template is not None:
        try:
            return template.format(**{k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in ctx.items()})
        except (KeyError, IndexError):
            pass
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    return "must be" + message.removeprefix("Input should be") if message.startswith("Input should be") else message


def _joined(reasons: Sequence[str]) -> str:
    """One reason from several (a union's members): "must be a string or a list"."""
    unique = list(dict.fromkeys(reasons))
    if len(unique) > 1 and all(r.startswith("must be ") for r in unique):
        return "must be " + " or ".join(r.removeprefix("must be ") for r in unique)
    return " or ".join(unique)


def _validation_error(exc: RequestValidationError, body_model: type[BaseModel] | None) -> APIError:
    """The first pydantic error as one message naming the field, the value (once) and the fix:
    `stop[1]=3 must be a string`."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "the request is invalid")
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail}); send one JSON object", code="invalid_json")
    if kind == LONE_SURROGATE:
        return APIError(400, str(first.get("msg", "")), param=(first.get("ctx") or {}).get("param") or None, code="invalid_unicode")
    if not loc:
        given = first.get("input")
        if kind == "missing" or isinstance(given, bytes | str):
            return APIError(400, "the request body was not read as JSON; send a JSON object with the header Content-Type: application/json")
        if kind.endswith("_type"):
            return APIError(400, f"the request body must be a JSON object (got {type(given).__name__}); send {{\"prompt\": ...}} or {{\"messages\": [...]}}")
        return APIError(400, str(first.get("msg", "")).removeprefix("Value error, "), code="invalid_value")
    body = getattr(exc, "body", None)
    if kind == "extra_forbidden":
        param = _param(_located(body, loc, kind)[0])
        fields = ""
        if body_model is not None and len(loc) == 1:
            fields = f" (this endpoint takes: {', '.join(body_model.model_fields)})"
        return APIError(400, f"unknown field {param!r}; remove it{fields}", param=param, code="unknown_field")
    if kind == "missing":
        param = _param(_located(body, loc, kind)[0])
        return APIError(400, f"{param} is required", param=param, code="missing_field")
    # the first error's field, and the errors inside it; a union reports one error per member, and
    # the one that got deepest into the value (stop[1] rather than stop) names the element that is wrong
    located = []
    for error in errors:
        error_loc = [p for p in error.get("loc", ()) if p != "body"]
        if error_loc:
            path, value = _located(body, error_loc, str(error.get("type", "")))
            if error.get("type") == INVALID_ITEM and isinstance(value, list):
                index = (error.get("ctx") or {}).get("index")
                if isinstance(index, int) and 0 <= index < len(value):
                    path, value = [*path, index], value[index]
            if not located or path[: len(located[0][0])] == located[0][0]:
                located.append((path, value, _reason(error)))
    deepest = max(len(path) for path, _, _ in located)
    path, value, _ = next(item for item in located if len(item[0]) == deepest)
    reasons = [reason for p, _, reason in located if p == path]
    param = _param(path)
    if value is _MISSING:  # a union member's field that is missing: messages[0].content[0].text
        return APIError(400, f"{param} is required", param=param, code="missing_field")
    return APIError(400, f"{param}={_shown(value)} {_joined(reasons)}", param=param, code="invalid_value")


def prompt_char_limit(tokenizer: Any, max_context: int | None) -> int | None:
    """The most characters a prompt can have and still fit in `max_context` tokens (None: no
    known context): context x the longest vocabulary entry x CHARS_PER_TOKEN_MARGIN."""
    if max_context is None:
        return None
    try:
        longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    except (AttributeError, NotImplementedError, TypeError):  # a tokenizer without a vocabulary to read
        return None
    return max_context * max(longest, 1) * CHARS_PER_TOKEN_MARGIN


def create_app(
    decoder: SpeculativeDecoder,
    model_name: str | None = None,
    max_batch_size: int = 8,
    max_queue: int = 64,
) -> FastAPI:
    """The OpenAI-compatible app over `decoder` (its models, method and accept rule are the
    defaults; requests may pick others in their `specdec` field).

    max_batch_size: rows decoded at once over all lanes; max_queue: requests that may wait
    for a row beyond those (more get 429)."""
    metrics = ServerMetrics()
    scheduler = Scheduler(decoder, max_batch_size=max_batch_size, max_queue=max_queue, metrics=metrics)
    served = model_name or default_model_name(decoder)
    created = now()
    char_limit = prompt_char_limit(decoder.tokenizer, decoder.max_context)
    tokenizing: list[ThreadPoolExecutor] = []
    """the thread that tokenizes, while the app runs"""

    async def drain(grace_s: float) -> None:
        """Stop taking requests (503) and answer every one in flight: those waiting for a row
        now, running ones when they finish or after `grace_s` seconds (503)."""
        scheduler.begin_stop(grace_s)
        while not scheduler.stopped:
            await asyncio.sleep(0.02)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizing.append(ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="specdec-tokenize"))
        scheduler.start()
        try:
            yield
        finally:
            await drain(0.0)
            tokenizing.pop().shutdown(wait=False)

    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.decoder = decoder
    app.state.model_name = served
    app.state.drain = drain
    app.add_middleware(_Guard, metrics=metrics)
    body_models: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

    # ----- errors ----------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc, body_models.get(request.url.path)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}; this server serves {', '.join(ENDPOINTS)}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            bad = exc.__cause__
            message = f"the request body is not valid UTF-8 (byte 0x{bad.object[bad.start]:02x} at offset {bad.start}); send JSON encoded as UTF-8"
        elif isinstance(exc.__cause__, RecursionError):
            message = "the request body is nested too deeply to parse; send a JSON object of the documented fields"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response(headers=getattr(exc, "headers", None))

    # ----- helpers ---------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != served:
            raise APIError(404, f"model {name!r} is not served here; this server serves {served!r} (GET /v1/models)", param="model", code="model_not_found")

    def check_size(chars: int, param: str) -> None:
        """Reject a prompt too long for the context by its characters, before tokenizing it."""
        if char_limit is not None and chars > char_limit:
            raise APIError(
                400,
                f"the prompt has {chars} characters, more than can fit in the model's context of {decoder.max_context} tokens "
                f"(at most {char_limit} characters with this tokenizer); shorten the prompt",
                param=param, code="context_length_exceeded",
            )

    async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` in the tokenizing thread, so that the event loop keeps serving meanwhile."""
        if not tokenizing:
            raise APIError(503, "the server is not running; retry against a running server", code="unavailable")
        return await asyncio.get_running_loop().run_in_executor(tokenizing[-1], partial(fn, *args, **kwargs))

    def check_context(prompt_ids: Sequence[int], max_tokens: int | None, prompt_param: str, default: int | None) -> int:
        """max_tokens (or the default) after checking prompt + max_tokens against the context."""
        limit = decoder.max_context
        n = len(prompt_ids)
        if limit is not None and n >= limit:
            raise APIError(
                400, f"the prompt has {n} tokens but the model's context is {limit} tokens; shorten the prompt",
                param=prompt_param, code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = default if default is not None else (limit - n if limit is not None else CHAT_DEFAULT_MAX_TOKENS)
            if limit is not None:
                max_tokens = min(max_tokens, limit - n)
        if limit is not None and n + max_tokens > limit:
            raise APIError(
                400,
                f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens, more than the model's context of "
                f"{limit} tokens; lower max_tokens to at most {limit - n} or shorten the prompt",
                param="max_tokens", code="context_length_exceeded",
            )
        return max_tokens

    def encode(text: str, param: str, special_tokens_in_text: bool = False) -> list[int]:
        """Token ids of a prompt (in the tokenizing thread)."""
        try:
            if special_tokens_in_text:
                return list(decoder.tokenizer(text, add_special_tokens=False)["input_ids"])
            return list(decoder.encode(text))
        except SpecDecError as err:
            raise APIError(400, f"{param}: {err}", param=param) from None

    def chat_ids(messages: list[tuple[str, str]]) -> list[int]:
        """Token ids of the chat prompt of `messages` (in the tokenizing thread)."""
        try:
            text, templated = chat_prompt(decoder.tokenizer, messages)
        except SpecDecError as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        check_size(len(text), "messages")
        return encode(text, "messages", special_tokens_in_text=templated)

    def submit(job: Job) -> None:
        try:
            scheduler.submit(job)
        except QueueFullError as err:
            raise APIError(
                429, f"the server is busy: {err.waiting} requests are already waiting for a batch row (--max-queue {err.limit}); retry later",
                code="queue_full",
            ) from None
        except SchedulerStoppedError:
            raise shutting_down() from None

    async def until_disconnected(request: Request) -> None:
        """Return when the client has closed the connection (the ASGI receive channel says so;
        the body was read before the handler ran)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def cancel_when_gone(job: Job, request: Request) -> None:
        await until_disconnected(request)
        scheduler.cancel(job)  # its row is freed at its lane's next step boundary
        job.events.put_nowait(Failed(APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection")))

    async def result(job: Job, request: Request) -> Finished:
        """Wait for a job's end; a client that closes the connection cancels it at once."""
        watcher = asyncio.create_task(cancel_when_gone(job, request))
        ended = False
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, Finished):
                    ended = True
                    return event
                if isinstance(event, Failed):
                    ended = True
                    raise event.error
        finally:
            watcher.cancel()
            if not ended:
                scheduler.cancel(job)

    async def stream(job: Job, make_chunk: Callable[[str | None, str | None], dict[str, Any]], usage_chunk: Callable[[Usage], dict[str, Any]] | None,
                     opening: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """Server-sent events of a job: `make_chunk(text, finish_reason)` per delta and at the end,
        then [DONE]; an error is one `{"error": ...}` event, then [DONE]. A client that goes away
        cancels the stream (Starlette listens for the disconnect), which cancels the job."""
        ended = False
        try:
            if opening is not None:
                yield _sse(opening)
            while True:
                event = await job.events.get()
                if isinstance(event, TextDelta):
                    yield _sse(make_chunk(event.text, None))
                elif isinstance(event, Finished):
                    ended = True
                    yield _sse(make_chunk(None, event.finish_reason))
                    if usage_chunk is not None:
                        yield _sse(usage_chunk(Usage.of(event.prompt_tokens, event.completion_tokens)))
                    yield SSE_DONE
                    return
                else:
                    ended = True
                    yield _sse(event.error.body())
                    yield SSE_DONE
                    return
        except Exception as err:  # a bug while streaming: the client still gets an error event
            log.exception("error while streaming a response")
            yield _sse(APIError(500, f"internal error while streaming: {err!r}").body())
            yield SSE_DONE
        finally:
            if not ended:  # the client went away mid-stream (or the stream failed): free its row
                scheduler.cancel(job)

    def report(event: Finished) -> DecodingReport:
        s = event.stats
        return DecodingReport(
            method=event.lane.method, verify=event.lane.verify, tau=s.tau, acceptance_rate=s.acceptance_rate, steps=s.steps,
            queue_ms=s.queue_s * 1e3, ttft_ms=s.ttft_s * 1e3, tpot_ms=s.tpot_s * 1e3,
        )

    def make_job(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_tokens: int, lane: LaneKey) -> Job:
        return Job(prompt_ids, max_tokens, lane, decoder.tokenizer, stop=body.stop_strings, seed=body.seed)

    # ----- endpoints -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        lane = resolve_lane(decoder, body.temperature, body.top_p, body.specdec)
        check_size(len(body.prompt_text), "prompt")
        prompt_ids = await off_loop(encode, body.prompt_text, "prompt")
        max_tokens = check_context(prompt_ids, body.max_tokens, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        job = make_job(body, prompt_ids, max_tokens, lane)
        submit(job)
        cid, stamp = new_id("cmpl"), now()
        if body.stream:
            def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
                return dump(Completion(id=cid, created=stamp, model=served, choices=[CompletionChoice(text=text or "", finish_reason=finish_reason)]))

            def usage(u: Usage) -> dict[str, Any]:
                return dump(Completion(id=cid, created=stamp, model=served, choices=[], usage=u))

            return StreamingResponse(stream(job, chunk, usage if body.include_usage else None), media_type="text/event-stream")
        event = await result(job, request)
        completion = Completion(
            id=cid, created=stamp, model=served, choices=[CompletionChoice(text=event.text, finish_reason=event.finish_reason)],
            usage=Usage.of(event.prompt_tokens, event.completion_tokens), specdec=report(event),
        )
        return JSONResponse(dump(completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        lane = resolve_lane(decoder, body.temperature, body.top_p, body.specdec)
        messages = [(m.role, m.text) for m in body.messages]
        check_size(sum(len(content) for _, content in messages), "messages")
        prompt_ids = await off_loop(chat_ids, messages)
        max_tokens = check_context(prompt_ids, body.token_limit, "messages", None)
        job = make_job(body, prompt_ids, max_tokens, lane)
        submit(job)
        cid, stamp = new_id("chatcmpl"), now()
        if body.stream:
            def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
                delta = ChatDelta(role="assistant" if role else None, content=text)
                payload = dump(ChatCompletionChunk(id=cid, created=stamp, model=served, choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)]))
                payload["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
                return payload

            def usage(u: Usage) -> dict[str, Any]:
                return dump(ChatCompletionChunk(id=cid, created=stamp, model=served, choices=[], usage=u))

            opening = chunk("", None, role=True)
            return StreamingResponse(stream(job, chunk, usage if body.include_usage else None, opening), media_type="text/event-stream")
        event = await result(job, request)
        completion = ChatCompletion(
            id=cid, created=stamp, model=served,
            choices=[ChatChoice(message=AssistantMessage(content=event.text), finish_reason=event.finish_reason)],
            usage=Usage.of(event.prompt_tokens, event.completion_tokens), specdec=report(event),
        )
        return JSONResponse(dump(completion))

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(dump(ModelList(data=[ModelCard(id=served, created=created)])))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        check_model(model_id)
        return JSONResponse(dump(ModelCard(id=served, created=created)))

    @app.get("/health")
    async def health() -> Response:
        body = {"status": "ok" if scheduler.alive else "unavailable", "model": served,
                "running_rows": scheduler.running_rows, "queue_depth": scheduler.queue_depth, "uptime_s": round(time.time() - metrics.started, 1)}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app
