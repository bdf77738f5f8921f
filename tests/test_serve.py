"""`specdec serve`: the OpenAI-compatible server over the tiny pair, through real HTTP (uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.api import SpeculativeDecoder
from specdec.cli import main
from specdec.engine import DecodeSession
from specdec.errors import SpecDecError
from specdec.serve import BackgroundServer, create_app
from specdec.serve.text import CompletionText, chat_prompt

PROMPTS = ["def add(a, b):", "for i in range(10):", "class A:", "print(i)", "return a + b", "def f(x):", "import os", "a = b"]
TIMEOUT = 30.0
ERROR_KEYS = {"message", "type", "param", "code"}


def load_decoder(pair: Path, method: str = "chain") -> SpeculativeDecoder:
    draft = str(pair / "draft") if method != "ar" else None
    return SpeculativeDecoder.from_pretrained(str(pair / "target"), draft, method=method, device="cpu")


@pytest.fixture(scope="module")
def decoder(tiny_pair_dir) -> SpeculativeDecoder:
    return load_decoder(tiny_pair_dir)


@pytest.fixture(scope="module")
def server(decoder):
    with BackgroundServer(create_app(decoder, model_name="tiny", max_batch_size=8, max_queue=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def slow_decoder(tiny_pair_dir) -> SpeculativeDecoder:
    """The tiny pair with a target that takes 30 ms per forward."""
    slow = load_decoder(tiny_pair_dir)
    slow.target.register_forward_pre_hook(lambda module, args: time.sleep(0.03))
    return slow


@pytest.fixture(scope="module")
def slow_server(slow_decoder):
    """One row and one waiting request at most, over the slow target."""
    with BackgroundServer(create_app(slow_decoder, max_batch_size=1, max_queue=1)) as srv:
        yield srv


def offline(decoder: SpeculativeDecoder, prompt: str, max_tokens: int, **kwargs) -> str:
    return decoder.generate(prompt, max_new_tokens=max_tokens, **kwargs).text


def complete(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/completions", json={"temperature": 0, "max_tokens": 16, **body})


def sse_payloads(lines) -> list:
    """The JSON payloads of an event stream, then "[DONE]" if it came."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


class Samples(dict):
    """Prometheus samples keyed 'name{label="value",...}'; a key's labels may come in any order."""

    @staticmethod
    def canonical(key: str) -> str:
        name, _, labels = key.partition("{")
        pairs = sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        return name + ("{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else "")

    def __getitem__(self, key: str) -> float:
        return super().__getitem__(self.canonical(key))

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        return super().get(self.canonical(key), default)


def scrape(client: httpx.Client) -> Samples:
    """GET /metrics, parsed by prometheus_client's own parser."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = Samples()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            samples[Samples.canonical(f"{sample.name}{{{labels}}}" if labels else sample.name)] = sample.value
    return samples


def assert_error(response: httpx.Response, status: int, needle: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert needle in body["error"]["message"], body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# ----- the API --------------------------------------------------------------------------------


def test_completion_is_the_offline_greedy_text(client, decoder):
    response = complete(client, prompt=PROMPTS[0], max_tokens=24)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == offline(decoder, PROMPTS[0], 24) and choice["finish_reason"] == "length"
    prompt_tokens = len(decoder.encode(PROMPTS[0]))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24, "total_tokens": prompt_tokens + 24}
    assert body["specdec"]["method"] == "chain" and body["specdec"]["verify"] == "greedy" and body["specdec"]["tau"] >= 1


def test_chat_uses_the_plain_template_without_a_chat_template(client, decoder):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "def add"}]}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == offline(decoder, "system: be brief\nuser: def add\nassistant:", 12)
    assert body["usage"]["completion_tokens"] == 12


def test_chat_template_of_the_tokenizer_is_used_when_present(decoder):
    assert chat_prompt(decoder.tokenizer, [("user", "hi")]) == ("user: hi\nassistant:", False)

    class Templated:
        chat_template = "<role>content ... <assistant>"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    class Rejecting(Templated):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            raise ValueError("Conversation roles must alternate user/assistant")

    assert chat_prompt(Templated(), [("system", "s"), ("user", "hi")]) == ("<system>s<user>hi<assistant>", True)
    with pytest.raises(SpecDecError, match="the model's chat template rejected the messages: Conversation roles must alternate"):
        chat_prompt(Rejecting(), [("user", "a"), ("user", "b")])


def test_streams_concatenate_to_the_non_streamed_text(client, decoder):
    expected = offline(decoder, PROMPTS[1], 20)
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length" and chunks[0]["choices"][0]["finish_reason"] is None

    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == offline(decoder, "user: x\nassistant:", 10)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10


def test_stop_strings_cut_the_text_and_end_the_row(client, decoder):
    full = offline(decoder, PROMPTS[0], 40)
    stop = full[3:6]
    assert stop and full.index(stop) == 3
    body = complete(client, prompt=PROMPTS[0], max_tokens=40, stop=[stop, "never-there"]).json()
    assert body["choices"][0] == {"index": 0, "text": full[:3], "logprobs": None, "finish_reason": "stop"}
    # usage counts the tokens of the text before the stop string, whatever the method committed past it
    assert body["usage"]["completion_tokens"] == len(decoder.tokenizer(full[:3], add_special_tokens=False)["input_ids"])
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True}) as r:
        events = sse_payloads(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full[:3] and events[-2]["choices"][0]["finish_reason"] == "stop"


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["object"] == "model"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_error(client.get("/v1/models/other"), 404, "'other' is not served here; this server serves 'tiny'", "model")
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == "tiny"


def test_metrics_move_after_requests(client):
    before = scrape(client)
    assert complete(client, prompt=PROMPTS[2], max_tokens=8).status_code == 200
    assert complete(client, prompt=PROMPTS[2], max_tokens=8, specdec={"method": "ar"}).status_code == 200
    assert complete(client, prompt=PROMPTS[2], temperature=5).status_code == 400
    after = scrape(client)

    def moved(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved('specdec_http_requests_total{endpoint="/v1/completions",status="200"}') == 2
    assert moved('specdec_http_requests_total{endpoint="/v1/completions",status="400"}') == 1
    assert moved('specdec_requests_finished_total{method="chain",finish_reason="length"}') == 1
    assert moved('specdec_requests_finished_total{method="ar",finish_reason="length"}') == 1
    assert moved('specdec_completion_tokens_total{method="chain"}') == 8 and moved('specdec_completion_tokens_total{method="ar"}') == 8
    assert moved('specdec_prompt_tokens_total{method="ar"}') == 3
    assert moved('specdec_verify_steps_total{method="ar"}') == 7  # the first token comes from the prefill
    assert moved('specdec_drafted_tokens_total{method="chain"}') > 0 and moved('specdec_drafted_tokens_total{method="ar"}') == 0
    assert moved('specdec_plain_row_steps_total{method="ar"}') == 7  # AR drafts nothing at any step
    assert moved('specdec_plain_row_steps_total{method="chain"}') < moved('specdec_verify_steps_total{method="chain"}')
    assert after['specdec_tau{method="ar"}'] == 1.0 and after['specdec_tau{method="chain"}'] >= 1.0
    assert 0 <= after['specdec_acceptance_rate{method="chain"}'] <= 1
    assert after["specdec_tokens_per_second"] > 0 and after["specdec_running_rows"] == 0 and after["specdec_queue_depth"] == 0
    assert after["specdec_lanes"] == 0  # idle lanes hold no work
    assert moved("specdec_time_to_first_token_seconds_count") == 2 and moved('specdec_request_latency_seconds_bucket{le="+Inf"}') == 2


# ----- errors ---------------------------------------------------------------------------------

LONG = "def add(a, b):\n" * 40  # 320 tokens of the tiny tokenizer; the context is 256

BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature=2.5 must be at most 2", "temperature"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature=-1 must be at least 0", "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p=0 must be greater than 0", "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p=1.5 must be at most 1", "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens=0 must be at least 1", "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens=\"ten\" must be an integer", "max_tokens"),
    ({"prompt": 5}, 400, "prompt=5 must be a string or a list", "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt=[\"a\", \"b\"] holds 2 prompts; one prompt per request is supported", "prompt"),
    ({}, 400, "prompt is required", "prompt"),
    ({"prompt": "x", "foo": 1}, 400, "unknown field 'foo'; remove it (this endpoint takes: model, max_tokens", "foo"),
    ({"prompt": "x", "specdec": {"methd": "ar"}}, 400, "unknown field 'specdec.methd'; remove it", "specdec.methd"),
    ({"prompt": "x", "n": 2}, 400, "n=2 is not supported: this server returns one choice per request; send 2 requests (with different seeds) instead", "n"),
    ({"prompt": "x", "stop": 5}, 400, "stop=5 must be a string or a list", "stop"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop=[\"a\", \"b\", \"c\", \"d\", \"e\"] holds 5 stop strings; send at most 4", "stop"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs=2 is not supported; leave the field out", "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options is only allowed with stream: true", None),
    ({"prompt": ""}, 400, "the prompt is empty", "prompt"),
    ({"prompt": "x", "max_tokens": 300}, 400, "the prompt has 1 tokens and max_tokens is 300: 301 tokens, more than the model's context of 256 tokens; lower max_tokens to at most 255", "max_tokens"),
    ({"prompt": LONG}, 400, "the prompt has 320 tokens but the model's context is 256 tokens; shorten the prompt", "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model 'gpt-4' is not served here; this server serves 'tiny'", "model"),
    ({"prompt": "x", "specdec": {"method": "medusa"}}, 400, "specdec.method 'medusa' is not known; choose one of ar, chain, static", "specdec.method"),
    ({"prompt": "x", "specdec": {"verify": "strict"}}, 400, "specdec.verify 'strict' is not known", "specdec.verify"),
    ({"prompt": "x", "temperature": 0.7, "specdec": {"verify": "greedy"}}, 400, "specdec.verify 'greedy' needs temperature 0 (got 0.7)", "specdec.verify"),
    ({"prompt": "x", "specdec": {"mars_theta": 0.8}}, 400, "specdec.mars_theta=0.8 applies only to verify \"mars\"", "specdec.mars_theta"),
    ({"prompt": "x", "specdec": {"verify": "mars", "mars_theta": -1}}, 400, "specdec.mars_theta=-1 must be greater than 0", "specdec.mars_theta"),
]


@pytest.mark.parametrize(("body", "status", "needle", "param"), BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_requests(client, body, status, needle, param):
    response = client.post("/v1/completions", json={"temperature": 0, **body})
    error = assert_error(response, status, needle, param)
    assert error["type"] == "invalid_request_error"


def test_bad_bodies_and_routes(client):
    headers = {"content-type": "application/json"}
    assert_error(client.post("/v1/completions", content=b"{not json", headers=headers), 400, "the request body is not valid JSON")
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=headers), 400, "the request body must be a JSON object (got list)")
    assert_error(client.post("/v1/completions", content=b'{"prompt": "x"}'), 400, "Content-Type: application/json")
    assert_error(client.post("/v1/completions", content=b'{"prompt": "x\xff"}', headers=headers), 400, "not valid UTF-8 (byte 0xff at offset 13)")
    assert_error(client.post("/v1/completions", content=b"[" * 100_000, headers=headers), 400, "nested too deeply")
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages=[] must have at least 1 item", "messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0].role=\"robot\" must be 'system', 'developer', 'user', 'assistant' or 'tool'", "messages[0].role")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5}), 400, "disagree")
    assert_error(client.post("/v1/completions", content=b" " * (4 * 2**20 + 1), headers=headers), 413, "more than the 4194304 this server takes")
    assert_error(client.get("/v1/nothing"), 404, "no such endpoint: GET /v1/nothing")
    assert_error(client.get("/v1/completions"), 405, "GET is not allowed on /v1/completions")


SEED_MAX = 2**64 - 1

VALUE_ERRORS = [
    # n < 1 is not "send 0 requests instead": n must be 1
    ({"n": 0}, "n=0 must be 1: specdec returns one choice per request", "n"),
    ({"n": -2}, "n=-2 must be 1: specdec returns one choice per request", "n"),
    # the value once (the handler used to append "(got ...)" to messages that already named it)
    ({"presence_penalty": 1.5}, "presence_penalty=1.5 is not supported (this server applies no penalties); leave the field out or send 0", "presence_penalty"),
    ({"frequency_penalty": -2}, "frequency_penalty=-2 is not supported (this server applies no penalties); leave the field out or send 0", "frequency_penalty"),
    ({"best_of": 3}, "best_of=3 is not supported; leave it out or send 1", "best_of"),
    ({"logit_bias": {"50256": 2}}, 'logit_bias={"50256": 2} is not supported; leave the field out', "logit_bias"),
    # an element of a list (or of an object) by its index (key), not the whole field as "list"
    ({"stop": ["a", ""]}, 'stop[1]="" must be non-empty; remove it', "stop[1]"),
    ({"stop": ""}, 'stop="" must be non-empty; leave the field out for no stop string', "stop"),
    ({"stop": ["a", 3]}, "stop[1]=3 must be a string", "stop[1]"),
    ({"prompt": ["a", 3]}, "prompt[1]=3 must be a string", "prompt[1]"),
    ({"logit_bias": {"50256": "x"}}, 'logit_bias["50256"]="x" must be a number', 'logit_bias["50256"]'),
    # seeds: the API's range (0 to 2**64 - 1) and wording
    ({"seed": SEED_MAX + 1}, f"seed={SEED_MAX + 1} does not fit in 64 bits; give an integer from 0 to {SEED_MAX}", "seed"),
    ({"seed": -1}, f"seed=-1 must be at least 0; give an integer from 0 to {SEED_MAX}", "seed"),
    ({"seed": 1.5}, "seed=1.5 must be an integer", "seed"),
    # a long value is shortened, not echoed whole
    ({"max_tokens": "9" * 1000}, 'max_tokens="' + "9" * 58 + '… must be an integer', "max_tokens"),
]


@pytest.mark.parametrize(("body", "message", "param"), VALUE_ERRORS, ids=[str(i) for i in range(len(VALUE_ERRORS))])
def test_a_bad_value_is_named_once_with_its_fix(client, body, message, param):
    error = assert_error(client.post("/v1/completions", json={"prompt": "x", "temperature": 0, **body}), 400, message, param)
    assert error["message"] == message and error["code"] == "invalid_value"


def test_a_bad_chat_content_part_is_named_by_its_index(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": 3}]}]
    error = assert_error(client.post("/v1/chat/completions", json={"messages": messages}), 400, "", "messages[0].content[1].text")
    assert error["message"] == "messages[0].content[1].text=3 must be a string"
    error = assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]}), 400, "", "messages[0].content")
    assert error["message"] == "messages[0].content=3 must be a string or a list"


def test_a_seed_takes_the_full_64_bits_as_in_the_api(client, decoder):
    """The server took seeds up to 2**63 - 1 only; the CLI and the API take up to 2**64 - 1."""
    for seed in (2**63, SEED_MAX):
        response = complete(client, prompt=PROMPTS[4], temperature=1.0, seed=seed)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == offline(decoder, PROMPTS[4], 16, temperature=1.0, seed=seed)


def _moved(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_lone_surrogate_is_a_400_everywhere(client):
    """JSON can spell a lone UTF-16 surrogate; it is not Unicode (no tokenizer takes it): 400 naming
    the field, on completions, chat and streams, and /metrics counts them."""
    headers = {"content-type": "application/json"}
    before = scrape(client)
    cases = [
        ("/v1/completions", b'{"prompt": "ab\\ud800c", "max_tokens": 4}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"], "stream": true}', "stop[0]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}], "stream": true}',
         "messages[0].content[0].text"),
    ]
    for path, body, param in cases:
        error = assert_error(client.post(path, content=body, headers=headers), 400, "holds a lone UTF-16 surrogate", param)
        assert error["code"] == "invalid_unicode" and error["type"] == "invalid_request_error"
    assert "\\ud800 at character 2" in client.post("/v1/completions", content=cases[0][1], headers=headers).json()["error"]["message"]
    pair = client.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2, "temperature": 0}', headers=headers)
    assert pair.status_code == 200  # a surrogate pair is one character
    after = scrape(client)
    assert _moved(before, after, 'specdec_http_requests_total{endpoint="/v1/completions",status="400"}') == 3
    assert _moved(before, after, 'specdec_http_requests_total{endpoint="/v1/chat/completions",status="400"}') == 2


def test_an_unexpected_error_is_an_openai_500_and_counted(client, monkeypatch):
    from specdec.serve.scheduler import Scheduler

    def broken(self, job):
        raise RuntimeError("a bug in submit")

    monkeypatch.setattr(Scheduler, "submit", broken)
    before = scrape(client)
    error = assert_error(complete(client, prompt="x"), 500, "internal error: RuntimeError('a bug in submit')")
    assert error["type"] == "server_error"
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 500 and json.loads(r.read())["error"]["type"] == "server_error"
    after = scrape(client)
    assert _moved(before, after, 'specdec_http_requests_total{endpoint="/v1/completions",status="500"}') == 2


def test_a_stopped_worker_answers_503_and_they_are_counted(decoder):
    app = create_app(decoder, model_name="tiny")
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        app.state.scheduler.stop()
        assert_error(complete(c, prompt=PROMPTS[0]), 503, "the server is shutting down; retry against a running server")
        assert c.get("/health").status_code == 503 and c.get("/health").json()["status"] == "unavailable"
        after = scrape(c)
    assert after['specdec_http_requests_total{endpoint="/v1/completions",status="503"}'] == 1
    assert after['specdec_http_requests_total{endpoint="/health",status="503"}'] == 2


def _raw_request(port: int, head: bytes, body_parts: list[bytes] = ()) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.sendall(head)
    for part in body_parts:
        sock.sendall(part)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of the one HTTP response on `sock` (read until the server closes it or the body is complete)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(head.split()[1]), body


def test_a_chunked_body_over_the_limit_gets_413(server):
    """Without Content-Length the limit is counted on the body as it streams in (the old check only
    read the header, so a chunked body of any size went through)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    part = b"x" * 2**16
    parts = [b"%x\r\n" % len(part) + part + b"\r\n"] * (4 * 2**4 + 1)  # 64 KiB more than 4 MiB, and no last chunk: the server must not wait for it
    sock = _raw_request(server.port, head, parts)
    try:
        status, body = _read_response(sock)
    finally:
        sock.close()
    assert status == 413
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and "so far, more than the 4194304 this server takes" in error["message"]


def test_a_flood_of_oversized_prompts_does_not_stall_the_server(client, server):
    """8 concurrent 1 MiB prompts (completions and chat) for a 256-token context: each is refused by
    its size without tokenizing, and /health answers within 100 ms meanwhile (tokenizing them on the
    event loop stalled it for seconds)."""
    prompt = "def add(a, b):\n    return a + b\n" * (2**20 // 32)
    bodies = [("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 4}).encode()) for _ in range(6)]
    bodies += [("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()) for _ in range(2)]
    answers: list[tuple[int, bytes]] = []

    def send(path: str, body: bytes) -> None:
        head = b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body))
        sock = _raw_request(server.port, head, [body])
        try:
            answers.append(_read_response(sock))
        finally:
            sock.close()

    baseline = []
    for _ in range(10):
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        baseline.append(time.perf_counter() - t0)
    senders = [threading.Thread(target=send, args=body) for body in bodies]
    latencies = []
    for t in senders:
        t.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in senders) and time.monotonic() < deadline:
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.005)
    for t in senders:
        t.join(TIMEOUT)
    assert len(answers) == 8
    for status, body in answers:
        assert status == 400 and "characters, more than can fit in the model's context of 256 tokens" in json.loads(body)["error"]["message"]
    assert latencies and max(latencies) - min(baseline) < 0.1, f"/health took up to {max(latencies) * 1e3:.0f} ms during the flood"


def test_ar_server_answers_400_for_methods_that_need_a_draft(tiny_pair_dir):
    ar = load_decoder(tiny_pair_dir, method="ar")
    assert ar.draft is None
    with BackgroundServer(create_app(ar)) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert_error(complete(c, prompt="x", specdec={"method": "chain"}), 400, "specdec.method 'chain' needs a draft model, but this server was started without one", "specdec.method")
        ok = complete(c, prompt=PROMPTS[0], max_tokens=6)
        assert ok.status_code == 200 and ok.json()["specdec"]["method"] == "ar"
        assert ok.json()["choices"][0]["text"] == offline(ar, PROMPTS[0], 6)


# ----- per-request decoding choices ---------------------------------------------------------


def test_per_request_method_and_accept_rule(client, decoder):
    expected = offline(decoder, PROMPTS[3], 16)
    for method in ("ar", "static", "eagle2", "dynatree"):
        body = complete(client, prompt=PROMPTS[3], specdec={"method": method}).json()
        assert body["specdec"]["method"] == method and body["choices"][0]["text"] == expected, method
    mars = complete(client, prompt=PROMPTS[3], specdec={"method": "chain", "verify": "mars", "mars_theta": 0.8}).json()
    assert mars["specdec"]["verify"] == "mars" and mars["usage"]["completion_tokens"] == 16
    sampled = complete(client, prompt=PROMPTS[3], temperature=0.9, top_p=0.8, specdec={"verify": "sampling", "top_k": 20}).json()
    # unseeded sampling may draw EOS before the budget: at most 16 tokens, finished for a reason
    assert sampled["specdec"]["verify"] == "sampling" and 1 <= sampled["usage"]["completion_tokens"] <= 16
    assert sampled["choices"][0]["finish_reason"] in ("length", "stop")


def test_seeded_sampling_alone_in_its_lane_is_reproducible(client, decoder):
    texts = [complete(client, prompt=PROMPTS[4], temperature=1.0, seed=1234).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1] == offline(decoder, PROMPTS[4], 16, temperature=1.0, seed=1234)


# ----- queueing, disconnects, failures --------------------------------------------------------


def test_full_queue_answers_429_and_a_disconnect_frees_the_row(slow_server):
    """max_batch_size 1, max_queue 1: one request runs, one waits, the third gets 429. The
    running client then disconnects mid-stream: its row goes to the waiting request."""
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "specdec": {"method": "ar"}}  # ~6 s at 30 ms per step
    with httpx.Client(base_url=slow_server.url, timeout=TIMEOUT) as c:
        before = scrape(c)
        waiting_result: list[httpx.Response] = []
        with httpx.Client(base_url=slow_server.url, timeout=TIMEOUT) as streaming, streaming.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running
            waiter = threading.Thread(target=lambda: waiting_result.append(complete(c, **{**body, "max_tokens": 4})))
            waiter.start()
            wait_for(lambda: c.get("/health").json()["queue_depth"] == 1)
            busy = assert_error(complete(c, prompt="x"), 429, "requests are already waiting for a batch row (--max-queue 1)")
            assert busy["type"] == "rate_limit_error" and busy["code"] == "queue_full"
            assert c.get("/health").json()["running_rows"] == 1
        t_closed = time.monotonic()  # the stream's client is gone: its row is freed, the waiting request runs
        waiter.join(TIMEOUT)
        assert waiting_result and waiting_result[0].status_code == 200 and waiting_result[0].json()["usage"]["completion_tokens"] == 4
        wait_for(lambda: (lambda h: h["running_rows"] == 0 and h["queue_depth"] == 0)(c.get("/health").json()), timeout=5)
        assert time.monotonic() - t_closed < 3.5, "the disconnected stream's 200 tokens were not decoded to the end"
        after = scrape(c)
        assert after['specdec_requests_finished_total{method="ar",finish_reason="cancelled"}'] - before.get('specdec_requests_finished_total{method="ar",finish_reason="cancelled"}', 0) == 1
        assert after["specdec_running_rows"] == 0
        assert after['specdec_http_requests_total{endpoint="/v1/completions",status="429"}'] >= 1


def _post_raw(port: int, body: dict) -> socket.socket:
    """A /v1/completions request on a raw socket (so the test can close the connection itself)."""
    data = json.dumps(body).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
    return _raw_request(port, head, [data])


def test_a_non_streamed_client_that_closes_frees_its_row_within_a_step(slow_server):
    """A token arrives every 30 ms step, so the old check (after 0.5 s without a token) never ran:
    the row decoded all 200 tokens for nobody. The closed connection must cancel it at once."""
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "specdec": {"method": "ar"}}  # ~6 s at 30 ms per step
    cancelled = 'specdec_requests_finished_total{method="ar",finish_reason="cancelled"}'
    with httpx.Client(base_url=slow_server.url, timeout=TIMEOUT) as c:
        before = scrape(c)
        sock = _post_raw(slow_server.port, body)
        wait_for(lambda: c.get("/health").json()["running_rows"] == 1)
        time.sleep(0.3)  # decoding
        sock.close()
        closed = time.monotonic()
        wait_for(lambda: c.get("/health").json()["running_rows"] == 0, timeout=6)
        freed_s = time.monotonic() - closed
        after = scrape(c)
    assert freed_s < 0.5, f"the row was freed {freed_s:.2f} s after the client closed"
    assert _moved(before, after, cancelled) == 1
    assert _moved(before, after, 'specdec_http_requests_total{endpoint="/v1/completions",status="499"}') == 1


def test_a_waiting_request_whose_client_closes_leaves_the_queue(slow_server):
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "specdec": {"method": "ar"}}
    with httpx.Client(base_url=slow_server.url, timeout=TIMEOUT) as c:
        before = scrape(c)
        with httpx.Client(base_url=slow_server.url, timeout=TIMEOUT) as streaming, streaming.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the one row runs this stream
            sock = _post_raw(slow_server.port, {**body, "max_tokens": 4})
            wait_for(lambda: c.get("/health").json()["queue_depth"] == 1)
            sock.close()
            wait_for(lambda: c.get("/health").json()["queue_depth"] == 0, timeout=2)
            health = c.get("/health").json()
            assert health["running_rows"] == 1  # the stream still runs
            events = []
            for line in lines:  # it is not disturbed
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 3:
                    break
        wait_for(lambda: c.get("/health").json()["running_rows"] == 0)  # the stream's client is gone too
        after = scrape(c)
    assert _moved(before, after, 'specdec_requests_finished_total{method="ar",finish_reason="cancelled"}') == 2  # the waiting one, then the stream


def test_a_failure_mid_stream_is_an_error_event_then_done(client, monkeypatch):
    """A lane's step fails after the stream has sent text: the client gets an error event (the
    OpenAI client raises it) and the stream still ends with [DONE]."""
    original_step = DecodeSession.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("step exploded mid-stream")
        return original_step(self)

    monkeypatch.setattr(DecodeSession, "step", step)
    before = scrape(client)
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "server_error" and "step exploded mid-stream" in error["message"]
    assert any(e["choices"][0]["text"] for e in events[:-2])  # text came before the failure
    after = scrape(client)
    assert _moved(before, after, 'specdec_requests_finished_total{method="chain",finish_reason="error"}') == 1


def test_a_failing_request_gets_500_and_the_others_are_served(client, decoder, monkeypatch):
    original_add = CompletionText.add

    def add(self, tokens):
        if "BOOM" in self.stop_strings:
            raise RuntimeError("text handling failed")
        return original_add(self, tokens)

    monkeypatch.setattr(CompletionText, "add", add)
    results: dict[str, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda: results.setdefault("bad", complete(client, prompt=PROMPTS[5], max_tokens=30, stop="BOOM"))),
        threading.Thread(target=lambda: results.setdefault("good", complete(client, prompt=PROMPTS[5], max_tokens=30))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    error = assert_error(results["bad"], 500, "text handling failed")
    assert error["type"] == "server_error"
    assert results["good"].json()["choices"][0]["text"] == offline(decoder, PROMPTS[5], 30)

    original_step = DecodeSession.step
    failures = iter([True])

    def step(self):
        if next(failures, False):
            raise RuntimeError("step exploded")
        return original_step(self)

    monkeypatch.setattr(DecodeSession, "step", step)
    assert_error(complete(client, prompt=PROMPTS[5]), 500, "step exploded")
    assert complete(client, prompt=PROMPTS[5], max_tokens=30).json()["choices"][0]["text"] == offline(decoder, PROMPTS[5], 30)
    assert client.get("/health").json()["status"] == "ok"


# ----- shutdown and the worker's lanes -----------------------------------------------------------

def test_stopping_answers_every_request_in_flight(slow_decoder):
    """Stopping (SIGTERM, Ctrl-C or `BackgroundServer.stop`) while two requests decode (one streamed)
    and one waits for a row: the waiting one gets a 503 at once; the running ones get the 1 s grace
    to finish, then a 503 JSON body, or an error event then [DONE]. (uvicorn used to cancel them
    after its timeout: a plain-text 500, and a stream cut with neither.)"""
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "specdec": {"method": "ar"}}  # ~6 s at 30 ms per step
    results: dict[str, tuple] = {}
    server = BackgroundServer(create_app(slow_decoder, max_batch_size=2, max_queue=4), shutdown_grace_s=1.0).start()
    try:
        def post(name: str, request: dict) -> None:
            response = httpx.post(server.url + "/v1/completions", json=request, timeout=TIMEOUT)
            results[name] = (response.status_code, response.json(), time.monotonic())

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
                results["stream"] = (r.status_code, sse_payloads(r.iter_lines()))

        clients = [threading.Thread(target=post, args=("running", body)), threading.Thread(target=stream)]
        for t in clients:
            t.start()
        wait_for(lambda: httpx.get(server.url + "/health").json()["running_rows"] == 2)
        clients.append(threading.Thread(target=post, args=("waiting", {**body, "max_tokens": 4})))
        clients[-1].start()
        wait_for(lambda: httpx.get(server.url + "/health").json()["queue_depth"] == 1)
        stopping = time.monotonic()
    finally:
        server.stop()
    for t in clients:
        t.join(TIMEOUT)
    status, waiting, answered = results["waiting"]
    assert status == 503 and waiting["error"]["code"] == "unavailable" and "the server is shutting down" in waiting["error"]["message"]
    assert answered - stopping < 0.9  # at once, not after the grace
    status, running, answered = results["running"]
    assert status == 503 and set(running["error"]) == ERROR_KEYS and "shut down before this request finished" in running["error"]["message"]
    assert answered - stopping >= 0.9  # after the grace
    status, events = results["stream"]
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "unavailable"
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events[:-2])


def _next_end(job):
    """The job's Finished or Failed event (text deltas skipped)."""
    from specdec.serve.scheduler import TextDelta

    async def wait():
        while isinstance(event := await job.events.get(), TextDelta):
            pass
        return event

    return asyncio.wait_for(wait(), TIMEOUT)


def test_a_drain_lets_running_work_finish_within_its_grace(decoder):
    """begin_stop(grace): a job waiting for a row gets 503 at once, a running one that ends within
    the grace is answered as usual, and the worker then ends."""
    from specdec.serve.scheduler import Failed, Finished, Job, Scheduler, resolve_lane

    async def run() -> tuple[object, object, bool]:
        scheduler = Scheduler(decoder, max_batch_size=1, max_queue=4)
        scheduler.start()
        lane = resolve_lane(decoder, 0.0, 1.0, None)
        ids = list(decoder.encode(PROMPTS[0]))
        running, waiting = Job(ids, 24, lane, decoder.tokenizer), Job(ids, 24, lane, decoder.tokenizer)
        scheduler.submit(running)
        scheduler.submit(waiting)
        while scheduler.running_rows != 1:
            await asyncio.sleep(0.005)
        scheduler.begin_stop(grace_s=30)
        assert not scheduler.alive
        ends = await _next_end(waiting), await _next_end(running)
        while not scheduler.stopped:
            await asyncio.sleep(0.01)
        return *ends, isinstance(ends[0], Failed) and isinstance(ends[1], Finished)

    waiting, running, kinds = asyncio.run(run())
    assert kinds, (waiting, running)
    assert waiting.error.status == 503 and "shutting down" in waiting.error.message
    assert running.finish_reason == "length" and running.completion_tokens == 24 and running.text == offline(decoder, PROMPTS[0], 24)


def test_a_job_that_has_produced_a_token_is_not_counted_as_waiting(decoder):
    """queue_depth is accepted jobs less running rows. The running count was published only after
    a lane's step, so a client that had its first token could still read the job as waiting
    (queue_depth 1 with one job running) and act on it (the full-queue test failed so under load).
    An admitted job holds its row before its prefill."""
    from specdec.serve.scheduler import Finished, Job, Scheduler, resolve_lane

    async def run() -> tuple[list[tuple[int, int]], object]:
        scheduler = Scheduler(decoder, max_batch_size=1, max_queue=4)
        seen: list[tuple[int, int]] = []
        on_tokens = scheduler._on_tokens

        def recording(lane, job, request, tokens):  # what a handler would read as the tokens go out
            seen.append((scheduler.queue_depth, scheduler.running_rows))
            on_tokens(lane, job, request, tokens)

        scheduler._on_tokens = recording
        scheduler.start()
        job = Job(list(decoder.encode(PROMPTS[1])), 4, resolve_lane(decoder, 0.0, 1.0, None), decoder.tokenizer)
        scheduler.submit(job)
        end = await _next_end(job)
        scheduler.stop()
        return seen, end

    seen, end = asyncio.run(run())
    assert isinstance(end, Finished) and seen
    assert all(state == (0, 1) for state in seen), seen


def test_idle_lanes_beyond_the_kept_ones_are_dropped(decoder):
    """Six lanes (six temperatures) used one after another: once idle they free their caches, and
    only the IDLE_LANES_KEPT most recently used are kept."""
    from specdec.serve.scheduler import IDLE_LANES_KEPT, Finished, Job, Scheduler, resolve_lane
    from specdec.serve.schemas import SpecDecOptions

    async def run() -> list:
        scheduler = Scheduler(decoder, max_batch_size=2)
        scheduler.start()
        ids = list(decoder.encode(PROMPTS[2]))
        keys = [resolve_lane(decoder, t, 1.0, SpecDecOptions(method="ar")) for t in (0.3, 0.5, 0.7, 0.9, 1.1, 1.3)]
        for key in keys:
            job = Job(ids, 4, key, decoder.tokenizer)
            scheduler.submit(job)
            assert isinstance(await _next_end(job), Finished)
        while scheduler.lane_count or scheduler.running_rows:
            await asyncio.sleep(0.005)
        kept = [(key, lane.session.idle, lane.session._holds_cache) for key, lane in scheduler._lanes.items()]
        scheduler.stop()
        return [keys, kept]

    keys, kept = asyncio.run(run())
    assert len(kept) == IDLE_LANES_KEPT == 4
    assert [key for key, _, _ in kept] == keys[-4:]  # least recently used first
    assert all(idle and not holds_cache for _, idle, holds_cache in kept)


# ----- clients ----------------------------------------------------------------------------------


def test_the_openai_client(server, decoder):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    completion = api.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=12, temperature=0)
    expected = offline(decoder, PROMPTS[6], 12)
    assert completion.choices[0].text == expected and completion.usage.completion_tokens == 12
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == offline(decoder, "user: hi\nassistant:", 8) and chat.choices[0].finish_reason == "length"
    streamed = api.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
    chat_stream = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True, extra_body={"specdec": {"method": "ar"}}
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model="tiny", prompt="x", temperature=3)


def test_load_32_clients_5_requests_each(server, decoder):
    """32 concurrent clients x 5 requests (mixed methods, some streamed) on 8 rows: no failure,
    every greedy text equal to the offline `generate` output."""
    expected = {p: offline(decoder, p, 16) for p in PROMPTS}

    async def one_client(http: httpx.AsyncClient, k: int) -> list[tuple[str, str]]:
        got = []
        for j in range(5):
            prompt = PROMPTS[(k * 5 + j) % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "specdec": {"method": "ar" if (k + j) % 3 == 0 else "chain"}}
            if j % 4 == 1:
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    events = sse_payloads([line async for line in r.aiter_lines()])
                assert events[-1] == "[DONE]"
                got.append((prompt, "".join(e["choices"][0]["text"] for e in events[:-1])))
            else:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                got.append((prompt, r.json()["choices"][0]["text"]))
        return got

    async def run() -> list[tuple[str, str]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as http:
            results = await asyncio.wait_for(asyncio.gather(*(one_client(http, k) for k in range(32))), timeout=50)
        return [pair for client_results in results for pair in client_results]

    pairs = asyncio.run(run())
    assert len(pairs) == 160
    wrong = [(p, t) for p, t in pairs if t != expected[p]]
    assert not wrong, f"{len(wrong)} responses differ from offline greedy decoding, e.g. {wrong[0]}"


def test_max_draft_rows_behind_the_server(tiny_pair_dir, decoder):
    """A server whose decoder drafts only while at most one row runs: 8 concurrent clients get
    the offline greedy text, and the metrics count the rows' plain steps."""
    limited = SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), method="chain", device="cpu", max_draft_rows=1)
    expected = {p: offline(decoder, p, 16) for p in PROMPTS}

    async def run(url: str) -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0}) for p in PROMPTS))
        return [(p, r.json()["choices"][0]["text"]) for p, r in zip(PROMPTS, responses, strict=True)]

    with BackgroundServer(create_app(limited, model_name="tiny", max_batch_size=8)) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        pairs = asyncio.run(run(srv.url))
        metrics = scrape(c)
    assert [t for _, t in pairs] == [expected[p] for p, _ in pairs]
    plain, steps = metrics['specdec_plain_row_steps_total{method="chain"}'], metrics['specdec_verify_steps_total{method="chain"}']
    assert plain > steps / 2, f"{plain} of {steps} row-steps plain: 8 rows at once should draft nothing"


# ----- command line -----------------------------------------------------------------------------


def test_specdec_serve_command(tiny_pair_dir):
    """`specdec serve --port 0`: it announces the free port it bound once it listens (it used to
    print ':0'), serves there, and drains a stream in flight on SIGTERM."""
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"),
           "--device", "cpu", "--port", "0", "--max-batch-size", "2", "--model-name", "cli", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr.extend(iter(proc.stderr.readline, b"")) if proc.stderr else None, daemon=True)
    reader.start()
    try:
        def announced() -> bool:
            assert proc.poll() is None, b"".join(stderr).decode()
            return any(b"specdec: serving 'cli' (chain) on http://127.0.0.1:" in line for line in stderr)

        wait_for(announced, timeout=40)
        line = next(line for line in stderr if b"specdec: serving" in line).decode()
        url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
        assert not url.endswith(":0") and httpx.get(url + "/health", timeout=5).status_code == 200
        response = httpx.post(url + "/v1/completions", json={"model": "cli", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}, timeout=TIMEOUT)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        # SIGTERM with a stream in flight: the server drains it (it ends with [DONE]) and exits cleanly
        body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.terminate()
            events = sse_payloads(lines)
        assert events[-1] == "[DONE]" and (events[-2].get("error") or events[-2]["choices"][0]["finish_reason"])
        assert proc.wait(20) in (0, -signal.SIGTERM)
        reader.join(5)
        assert b"Traceback" not in b"".join(stderr)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)


def test_serve_on_port_0_announces_the_port_it_bound(decoder, monkeypatch):
    """`serve(port=0)` listens on a free port; on_listening gets the URL with that port, not :0."""
    import specdec.serve.server as server_module

    servers = []
    make = server_module._server

    def keep(*args, **kwargs):
        servers.append(make(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(server_module, "_server", keep)
    urls: list[str] = []
    kwargs = {"port": 0, "log_level": "warning", "on_listening": urls.append}
    thread = threading.Thread(target=server_module.serve, args=(create_app(decoder),), kwargs=kwargs, daemon=True)
    thread.start()
    try:
        wait_for(lambda: bool(urls) or not thread.is_alive(), timeout=40)
        assert len(urls) == 1 and re.fullmatch(r"http://127\.0\.0\.1:\d+", urls[0]), urls
        assert int(urls[0].rsplit(":", 1)[1]) != 0
        assert httpx.get(urls[0] + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        for srv in servers:
            srv.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "--max-batch-size", "0"], "--max-batch-size 0 must be a positive integer"),
        (["serve", "--port", "70000"], "--port 70000 is not a TCP port"),
        (["serve", "--max-queue", "-1"], "--max-queue -1 must be 0 or more"),
        (["bench-serve", "--methods", "ar,hf", "--out", "x"], "bench-serve runs the engine's methods only"),
        (["bench-serve", "--concurrency", "0", "--out", "x"], "--concurrency: 0 must be a positive integer"),
    ],
)
def test_server_commands_reject_bad_flags(args, needle, capsys):
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_bench_serve_on_the_tiny_pair(tiny_pair_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:3]) + "\n")
    out = tmp_path / "bench"
    args = ["bench-serve", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"), "--device", "cpu",
            "--prompts", str(prompts), "--methods", "ar,chain", "--concurrency", "1,3", "--requests-per-client", "2", "--max-tokens", "8", "--out", str(out)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    levels = {(lv["label"], lv["concurrency"]): lv for lv in results["levels"]}
    assert set(levels) == {("ar", 1), ("ar", 3), ("chain", 1), ("chain", 3)}
    for level in levels.values():
        assert level["failed"] == 0 and level["requests"] == 2 * level["concurrency"]
        assert level["completion_tokens"] == 8 * level["requests"] and level["throughput_tok_s"] > 0 and level["ttft_ms_p50"] > 0
        assert level["matches_ar"] == 1.0  # greedy: every method's text equals AR's
    assert levels[("ar", 3)]["speedup_vs_ar"] == 1.0 and levels[("chain", 3)]["speedup_vs_ar"] > 0
    report = (out / "report.md").read_text()
    assert "| `chain` | 3 |" in report and "speedup vs AR" in report
    assert (out / "serve.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_bench_serve_trims_long_prompts_for_a_tokenizer_that_adds_a_bos(tiny_pair_dir):
    """Trimming kept the last `room` tokens of the encoding *with* its BOS, so the re-encoded text
    (BOS added again) had room + 1 tokens and the prompt was dropped; every long prompt was lost."""
    from types import SimpleNamespace

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from specdec.bench.serving import _fitting_prompts

    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    assert tok("x = 1")["input_ids"][0] == bos
    decoder = SimpleNamespace(max_context=64, tokenizer=tok, encode=lambda text: tok(text)["input_ids"])
    texts = ["def add(a, b):\n    return a + b\n" * 20, "for i in range(10):\n    print(i)\n" * 20, "x = 1"]
    fitting = _fitting_prompts(decoder, texts, max_tokens=16)  # room: 48 tokens, BOS included
    assert len(fitting) == 3 and fitting[2] == "x = 1"
    for trimmed, original in zip(fitting[:2], texts[:2], strict=True):
        assert original.endswith(trimmed) and 40 <= len(tok(trimmed)["input_ids"]) <= 48


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_boolean_is_not_a_number(client, field):
    """JSON `true` must not be read as 1.0 (pydantic's lax mode would)."""
    response = complete(client, prompt="def f(x):", max_tokens=4, **{field: True})
    assert_error(response, 400, "boolean", param=field)


def test_bench_serve_concurrency_beyond_the_open_file_limit(monkeypatch, tmp_path, capsys):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1024))
    import specdec.bench.serving

    monkeypatch.setattr(specdec.bench.serving, "load_pair", lambda *a, **k: pytest.fail("a model was loaded before the bad value was reported"))
    assert main(["bench-serve", "--concurrency", "1,1000", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--concurrency 1000 needs about" in err and "limit of 1024 (ulimit -n)" in err and "--concurrency 384 or less" in err
