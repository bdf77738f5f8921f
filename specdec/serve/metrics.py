"""Server metrics for `GET /metrics`, kept and written in the Prometheus text format by
`prometheus_client`, in a registry of the app's own (never the process-wide default one).

Counters only grow; gauges are read at scrape time. τ and the acceptance rate are computed
with `specdec.stats.tau` and `specdec.stats.acceptance_rate` over each method's last
`STEP_WINDOW` row-steps (so they follow the current traffic); the lifetime counters
(`specdec_verify_steps_total`, `specdec_accepted_tokens_total`, `specdec_drafted_tokens_total`)
give the long-run figures: τ = 1 + accepted / steps, acceptance = accepted / drafted.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.stats import acceptance_rate, tau

STEP_WINDOW = 4096
"""row-steps per method behind the τ and acceptance-rate gauges"""
THROUGHPUT_WINDOW_S = 10.0
"""seconds behind the tokens/s gauge"""
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
"""the Content-Type of `render()`'s text"""


class ServerMetrics:
    """Thread-safe counters, gauges and histograms fed by the handlers and the decode worker."""

    def __init__(self) -> None:
        self.started = time.time()
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_requests = Counter("specdec_http_requests", "HTTP responses by endpoint and status code.", ["endpoint", "status"], registry=registry)
        self.finished = Counter(
            "specdec_requests_finished", "Generations ended, by method and finish reason (stop, length, cancelled, error).",
            ["method", "finish_reason"], registry=registry,
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished generations, by method.", ["method"], registry=registry)
        self.completion_tokens = Counter("specdec_completion_tokens", "Generated tokens of finished generations, by method.", ["method"], registry=registry)
        self.steps = Counter("specdec_verify_steps", "Row-steps: one batch row in one verification step, by method.", ["method"], registry=registry)
        self.accepted = Counter("specdec_accepted_tokens", "Accepted draft tokens, by method.", ["method"], registry=registry)
        self.drafted = Counter("specdec_drafted_tokens", "Drafted tokens sent to verification, by method.", ["method"], registry=registry)
        self.plain_steps = Counter(
            "specdec_plain_row_steps",
            "Row-steps that drafted nothing (the target alone, as AR: --max-draft-rows, CAST's plain steps, a last token), by method.",
            ["method"], registry=registry,
        )
        self.tau = Gauge(
            "specdec_tau", f"Mean tokens committed per step (accepted + 1, specdec.stats.tau) over the method's last {STEP_WINDOW} row-steps.",
            ["method"], registry=registry,
        )
        self.acceptance = Gauge(
            "specdec_acceptance_rate", f"Accepted / drafted tokens (specdec.stats.acceptance_rate) over the method's last {STEP_WINDOW} row-steps.",
            ["method"], registry=registry,
        )
        Gauge(
            "specdec_tokens_per_second", f"Tokens committed per second over the last {THROUGHPUT_WINDOW_S:g} s, all requests.", registry=registry
        ).set_function(self.tokens_per_s)
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds", "From arrival to the first generated token (queueing + prefill).",
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self.latency = Histogram("specdec_request_latency_seconds", "From arrival to the last generated token.", buckets=LATENCY_BUCKETS_S, registry=registry)
        self._lock = threading.Lock()
        """guards the windows below"""
        self._window: dict[str, deque[tuple[int, int]]] = defaultdict(lambda: deque(maxlen=STEP_WINDOW))
        """method -> (accepted_len, drafted) of its latest row-steps"""
        self._committed: deque[tuple[float, int]] = deque()
        """(time, tokens committed) of recent steps, for tokens/s"""

    # ----- updates ---------------------------------------------------------------------
    def count_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()

    def observe_step(self, method: str, accepted_lens: Iterable[int], drafted: Iterable[int]) -> None:
        """One verification step of a lane: each active row's accepted length and drafted tokens."""
        pairs = list(zip(accepted_lens, drafted, strict=True))
        with self._lock:
            new_method = method not in self._window
            self._window[method].extend(pairs)
        if new_method:  # the method's gauges read its window at scrape time
            self.tau.labels(method).set_function(partial(self.window_tau, method))
            self.acceptance.labels(method).set_function(partial(self.window_acceptance, method))
        self.steps.labels(method).inc(len(pairs))
        self.accepted.labels(method).inc(sum(acc for acc, _ in pairs))
        self.drafted.labels(method).inc(sum(dr for _, dr in pairs))
        self.plain_steps.labels(method).inc(sum(1 for _, dr in pairs if dr == 0))

    def observe_tokens(self, committed: int) -> None:
        """Tokens committed to some request (its first token at prefill, or a step's accepted + bonus)."""
        now = time.monotonic()
        with self._lock:
            self._committed.append((now, committed))
            self._trim(now)

    def observe_finish(self, method: str, reason: str, prompt_tokens: int, completion_tokens: int, ttft_s: float | None, latency_s: float) -> None:
        self.finished.labels(method, reason).inc()
        self.prompt_tokens.labels(method).inc(prompt_tokens)
        self.completion_tokens.labels(method).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(latency_s)

    def register_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time (e.g. the scheduler's queue depth)."""
        Gauge(name, help_text, registry=self.registry).set_function(read)

    def _trim(self, now: float) -> None:
        while self._committed and self._committed[0][0] < now - THROUGHPUT_WINDOW_S:
            self._committed.popleft()

    # ----- reading ---------------------------------------------------------------------
    def tokens_per_s(self) -> float:
        """Tokens committed over the last THROUGHPUT_WINDOW_S seconds (or since start), per second."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._committed)
        span = min(THROUGHPUT_WINDOW_S, max(time.time() - self.started, 1e-9))
        return total / span

    def window_tau(self, method: str) -> float:
        with self._lock:
            return tau([acc for acc, _ in self._window.get(method, ())])

    def window_acceptance(self, method: str) -> float:
        with self._lock:
            window = list(self._window.get(method, ()))
        return acceptance_rate(sum(a for a, _ in window), sum(d for _, d in window))

    def render(self) -> str:
        """The Prometheus text exposition of every metric (`CONTENT_TYPE`)."""
        return generate_latest(self.registry).decode("utf-8")
