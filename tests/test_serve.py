"""`specdec serve`: the OpenAI-compatible server over the tiny pair, through real HTTP (uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

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
def slow_server(tiny_pair_dir):
    """One row, one waiting request at most, and a target that takes 30 ms per forward."""
    slow = load_decoder(tiny_pair_dir)
    slow.target.register_forward_pre_hook(lambda module, args: time.sleep(0.03))
    with BackgroundServer(create_app(slow, max_batch_size=1, max_queue=1)) as srv:
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


def scrape(client: httpx.Client) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
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
    assert after['specdec_tau{method="ar"}'] == 1.0 and after['specdec_tau{method="chain"}'] >= 1.0
    assert 0 <= after['specdec_acceptance_rate{method="chain"}'] <= 1
    assert after["specdec_tokens_per_second"] > 0 and after["specdec_running_rows"] == 0 and after["specdec_queue_depth"] == 0
    assert after["specdec_lanes"] == 0  # idle lanes hold no work
    assert moved("specdec_time_to_first_token_seconds_count") == 2 and moved('specdec_request_latency_seconds_bucket{le="+Inf"}') == 2


# ----- errors ---------------------------------------------------------------------------------

LONG = "def add(a, b):\n" * 40  # 320 tokens of the tiny tokenizer; the context is 256

BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature: Input should be less than or equal to 2 (got 2.5)", "temperature"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature: Input should be greater than or equal to 0", "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0", "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p: Input should be less than or equal to 1", "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens: Input should be greater than or equal to 1 (got 0)", "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens: Input should be a valid integer", "max_tokens"),
    ({"prompt": 5}, 400, "prompt: Input should be a valid string", "prompt"),
    ({"prompt": ["a", "b"]}, 400, "one prompt per request is supported, got a list of 2", "prompt"),
    ({}, 400, "prompt is required", "prompt"),
    ({"prompt": "x", "foo": 1}, 400, "unknown field 'foo'; remove it (this endpoint takes: model, max_tokens", "foo"),
    ({"prompt": "x", "specdec": {"methd": "ar"}}, 400, "unknown field 'specdec.methd'; remove it", "specdec.methd"),
    ({"prompt": "x", "n": 2}, 400, "n=2 is not supported: this server returns one choice per request", "n"),
    ({"prompt": "x", "stop": 5}, 400, "stop: Input should be a valid string", "stop"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 stop strings are allowed, got 5", "stop"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs are not supported", "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options is only allowed with stream: true", None),
    ({"prompt": ""}, 400, "the prompt is empty", "prompt"),
    ({"prompt": "x", "max_tokens": 300}, 400, "the prompt has 1 tokens and max_tokens is 300: 301 tokens, more than the model's context of 256 tokens; lower max_tokens to at most 255", "max_tokens"),
    ({"prompt": LONG}, 400, "the prompt has 320 tokens but the model's context is 256 tokens; shorten the prompt", "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model 'gpt-4' is not served here; this server serves 'tiny'", "model"),
    ({"prompt": "x", "specdec": {"method": "medusa"}}, 400, "specdec.method 'medusa' is not known; choose one of ar, chain, static", "specdec.method"),
    ({"prompt": "x", "specdec": {"verify": "strict"}}, 400, "specdec.verify 'strict' is not known", "specdec.verify"),
    ({"prompt": "x", "temperature": 0.7, "specdec": {"verify": "greedy"}}, 400, "specdec.verify 'greedy' needs temperature 0 (got 0.7)", "specdec.verify"),
    ({"prompt": "x", "specdec": {"mars_theta": 0.8}}, 400, "specdec.mars_theta=0.8 applies only to verify \"mars\"", "specdec.mars_theta"),
    ({"prompt": "x", "specdec": {"verify": "mars", "mars_theta": -1}}, 400, "specdec.mars_theta: Input should be greater than 0", "specdec.mars_theta"),
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
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages: List should have at least 1 item", "messages")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0].role: Input should be", "messages[0].role")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5}), 400, "disagree")
    assert_error(client.post("/v1/completions", content=b" " * (4 * 2**20 + 1), headers=headers), 413, "more than the 4194304 this server takes")
    assert_error(client.get("/v1/nothing"), 404, "no such endpoint: GET /v1/nothing")
    assert_error(client.get("/v1/completions"), 405, "GET is not allowed on /v1/completions")


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
    assert sampled["specdec"]["verify"] == "sampling" and sampled["usage"]["completion_tokens"] == 16


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


# ----- command line -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_specdec_serve_command(tiny_pair_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"),
           "--device", "cpu", "--port", str(port), "--max-batch-size", "2", "--model-name", "cli", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=40)
        response = httpx.post(url + "/v1/completions", json={"model": "cli", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}, timeout=TIMEOUT)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.terminate()
        proc.wait(20)


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
