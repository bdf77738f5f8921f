"""Server metrics in the Prometheus text format (`GET /metrics`).

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

from specdec.stats import acceptance_rate, tau

STEP_WINDOW = 4096
"""row-steps per method behind the τ and acceptance-rate gauges"""
THROUGHPUT_WINDOW_S = 10.0
"""seconds behind the tokens/s gauge"""
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


def _number(value: float) -> str:
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.total += 1
        self.sum += value


class ServerMetrics:
    """Thread-safe counters and histograms fed by the handlers and the decode worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.http_requests: dict[tuple[str, str], int] = defaultdict(int)
        """(endpoint, status code) -> responses"""
        self.finished: dict[tuple[str, str], int] = defaultdict(int)
        """(method, finish reason) -> finished generations"""
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.steps: dict[str, int] = defaultdict(int)
        """method -> row-steps (one row in one verification step)"""
        self.accepted: dict[str, int] = defaultdict(int)
        self.drafted: dict[str, int] = defaultdict(int)
        self._window: dict[str, deque[tuple[int, int]]] = defaultdict(lambda: deque(maxlen=STEP_WINDOW))
        """method -> (accepted_len, drafted) of its latest row-steps"""
        self._committed: deque[tuple[float, int]] = deque()
        """(time, tokens committed) of recent steps, for tokens/s"""
        self.ttft = _Histogram(LATENCY_BUCKETS_S)
        self.latency = _Histogram(LATENCY_BUCKETS_S)
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        """name -> (help, reader): gauges read at scrape time, e.g. the scheduler's queue depth"""

    # ----- updates ---------------------------------------------------------------------
    def count_http(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http_requests[(endpoint, str(status))] += 1

    def observe_step(self, method: str, accepted_lens: Iterable[int], drafted: Iterable[int]) -> None:
        """One verification step of a lane: each active row's accepted length and drafted tokens."""
        with self._lock:
            window = self._window[method]
            for acc, dr in zip(accepted_lens, drafted, strict=True):
                window.append((acc, dr))
                self.steps[method] += 1
                self.accepted[method] += acc
                self.drafted[method] += dr

    def observe_tokens(self, committed: int) -> None:
        """Tokens committed to some request (its first token at prefill, or a step's accepted + bonus)."""
        now = time.monotonic()
        with self._lock:
            self._committed.append((now, committed))
            self._trim(now)

    def observe_finish(self, method: str, reason: str, prompt_tokens: int, completion_tokens: int, ttft_s: float | None, latency_s: float) -> None:
        with self._lock:
            self.finished[(method, reason)] += 1
            self.prompt_tokens[method] += prompt_tokens
            self.completion_tokens[method] += completion_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            self.latency.observe(latency_s)

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
        """The Prometheus text exposition (format 0.0.4)."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels.items())} {_number(value)}")

        with self._lock:
            http = sorted(self.http_requests.items())
            finished = sorted(self.finished.items())
            prompt_tokens = sorted(self.prompt_tokens.items())
            completion_tokens = sorted(self.completion_tokens.items())
            steps = sorted(self.steps.items())
            accepted = sorted(self.accepted.items())
            drafted = sorted(self.drafted.items())
            methods = sorted(self._window)
        family("specdec_http_requests_total", "counter", "HTTP responses by endpoint and status code.",
               [({"endpoint": e, "status": s}, n) for (e, s), n in http])
        family("specdec_requests_finished_total", "counter", "Generations ended, by method and finish reason (stop, length, cancelled, error).",
               [({"method": m, "finish_reason": r}, n) for (m, r), n in finished])
        family("specdec_prompt_tokens_total", "counter", "Prompt tokens of finished generations, by method.",
               [({"method": m}, n) for m, n in prompt_tokens])
        family("specdec_completion_tokens_total", "counter", "Generated tokens of finished generations, by method.",
               [({"method": m}, n) for m, n in completion_tokens])
        family("specdec_verify_steps_total", "counter", "Row-steps: one batch row in one verification step, by method.",
               [({"method": m}, n) for m, n in steps])
        family("specdec_accepted_tokens_total", "counter", "Accepted draft tokens, by method.", [({"method": m}, n) for m, n in accepted])
        family("specdec_drafted_tokens_total", "counter", "Drafted tokens sent to verification, by method.", [({"method": m}, n) for m, n in drafted])
        family("specdec_tau", "gauge", f"Mean tokens committed per step (accepted + 1, specdec.stats.tau) over the method's last {STEP_WINDOW} row-steps.",
               [({"method": m}, self.window_tau(m)) for m in methods])
        family("specdec_acceptance_rate", "gauge",
               f"Accepted / drafted tokens (specdec.stats.acceptance_rate) over the method's last {STEP_WINDOW} row-steps.",
               [({"method": m}, self.window_acceptance(m)) for m in methods])
        family("specdec_tokens_per_second", "gauge", f"Tokens committed per second over the last {THROUGHPUT_WINDOW_S:g} s, all requests.",
               [({}, self.tokens_per_s())])
        for name, (help_text, read) in sorted(self._gauges.items()):
            family(name, "gauge", help_text, [({}, read())])
        for name, help_text, hist in (
            ("specdec_time_to_first_token_seconds", "From arrival to the first generated token (queueing + prefill).", self.ttft),
            ("specdec_request_latency_seconds", "From arrival to the last generated token.", self.latency),
        ):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} histogram")
            with self._lock:
                counts, total, total_s = list(hist.counts), hist.total, hist.sum
            for edge, count in zip(hist.buckets, counts, strict=True):
                lines.append(f'{name}_bucket{{le="{_number(edge)}"}} {count}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {total}')
            lines.append(f"{name}_sum {_number(total_s)}")
            lines.append(f"{name}_count {total}")
        return "\n".join(lines) + "\n"

    def register_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time (e.g. the scheduler's queue depth)."""
        self._gauges[name] = (help_text, read)
