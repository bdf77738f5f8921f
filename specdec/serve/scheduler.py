"""The decode worker: one thread owns the models and steps every lane's decode session.

Request handlers (asyncio) build a `Job` and `submit` it; the worker admits jobs into
*lanes*, steps the lanes in turn, and sends each job's text deltas and its end back to the
handler's asyncio queue (`loop.call_soon_threadsafe`).

A lane is one `DecodeSession` over its own engine, keyed by the settings a batch must share
(`LaneKey`: method, accept rule, MARS θ, temperature, top-p, top-k): the engine applies one
`SamplingParams` and one accept rule to all rows of a batch. Lanes share the target and
draft weights; each has its own KV caches, draft source and policy. Within a lane, requests
join free rows at a step boundary and leave when they finish (the rolling batch of
`specdec.engine`). `max_batch_size` bounds the rows of all lanes together; a job waits
(FIFO, whatever its lane) until a row is free. A lane with nothing left to do frees its KV caches; the
`IDLE_LANES_KEPT` most recently used idle lanes are kept for reuse, older ones dropped.

Failures stay with their request: an error while admitting a job, or in its text
handling, fails that job only (500); an error inside a lane's step fails the jobs of that
lane (they shared the batch) and drops the lane. The worker keeps serving either way.

Stopping drains: `begin_stop(grace_s)` refuses new jobs, answers the jobs still waiting for
a row with 503 at once, keeps stepping the running ones for up to `grace_s` seconds, then
answers what is left with 503 and ends the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from specdec.api import SpeculativeDecoder, resolve_verify
from specdec.engine import DecodeRequest, DecodeSession
from specdec.errors import SpecDecError
from specdec.methods import POLICY_CLASSES
from specdec.sampling import SamplingParams
from specdec.serve.errors import CLIENT_CLOSED_REQUEST, APIError
from specdec.serve.metrics import ServerMetrics
from specdec.serve.schemas import SpecDecOptions
from specdec.stats import GenerationStats
from specdec.text import CompletionText
from specdec.verification import RULE_OPTIONS, make_rule

log = logging.getLogger("specdec.serve")


# ----- lanes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneKey:
    """The decoding settings rows of one batch must share."""

    method: str
    verify: str
    """resolved accept rule: greedy, sampling or mars"""
    mars_theta: float | None
    """None: the rule's default (mars) or no option (other rules)"""
    temperature: float
    top_p: float
    top_k: int

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @property
    def verify_options(self) -> dict[str, Any]:
        return {"theta": self.mars_theta} if self.mars_theta is not None else {}


IDLE_LANES_KEPT = 4
"""idle lanes kept (caches freed) for reuse, most recently used first: their policies keep
their state (DynaTree's history, CAST's cost tables) across bursts of requests"""


def resolve_lane(decoder: SpeculativeDecoder, temperature: float, top_p: float, options: SpecDecOptions | None) -> LaneKey:
    """The lane of a request: the server's method and rule unless `options` (the request's
    `specdec` field) picks others. An APIError (400) names a bad choice and the fix."""
    opts = options or SpecDecOptions()
    method = opts.method if opts.method is not None else decoder.method
    if method not in POLICY_CLASSES:
        raise APIError(400, f"specdec.method {method!r} is not known; choose one of {', '.join(POLICY_CLASSES)}", param="specdec.method")
    if decoder.lacks_draft_for(method):
        raise APIError(
            400,
            f"specdec.method {method!r} needs a draft model, but this server was started without one (--method {decoder.method}); "
            "send specdec.method \"ar\", or restart the server with a draft model (e.g. `specdec serve --method chain`)",
            param="specdec.method",
        )
    rule = opts.verify if opts.verify is not None else decoder.verify
    if rule not in (None, "auto", *RULE_OPTIONS):
        raise APIError(400, f"specdec.verify {rule!r} is not known; choose one of auto, {', '.join(RULE_OPTIONS)}", param="specdec.verify")
    try:
        verify = resolve_verify(rule, temperature)
    except SpecDecError:
        raise APIError(
            400, f"specdec.verify {rule!r} needs temperature 0 (got {temperature}); send temperature 0, or verify \"sampling\" to sample losslessly",
            param="specdec.verify",
        ) from None
    theta = opts.mars_theta
    if theta is not None and verify != "mars":
        raise APIError(
            400, f"specdec.mars_theta={theta} applies only to verify \"mars\" (this request verifies with {verify!r}); add \"verify\": \"mars\" or drop mars_theta",
            param="specdec.mars_theta",
        )
    if verify == "mars":
        if theta is None and decoder.verify == "mars":
            theta = decoder.verify_options.get("theta")
        try:
            make_rule("mars", **({"theta": theta} if theta is not None else {}))
        except SpecDecError as err:
            raise APIError(400, f"specdec.mars_theta: {err}", param="specdec.mars_theta") from None
    if temperature == 0:  # greedy ignores top-p/top-k: one lane for every greedy request
        return LaneKey(method, verify, theta, 0.0, 1.0, 0)
    return LaneKey(method, verify, theta, float(temperature), float(top_p), int(opts.top_k))


class Lane:
    """One decode session (own engine and KV caches) for one `LaneKey`."""

    def __init__(self, key: LaneKey, session: DecodeSession) -> None:
        self.key = key
        self.session = session
        self.jobs: list[Job] = []
        """jobs submitted to the session and not yet reported"""


# ----- jobs and their events ----------------------------------------------------------------


@dataclass
class TextDelta:
    """New final text of a job."""

    text: str


@dataclass
class Finished:
    """A job's end: its whole text and figures."""

    text: str
    finish_reason: str
    """OpenAI's: 'stop' (EOS or a stop string) or 'length'"""
    prompt_tokens: int
    completion_tokens: int
    stats: GenerationStats
    lane: LaneKey


@dataclass
class Failed:
    """A job that could not be completed."""

    error: APIError


JobEvent = TextDelta | Finished | Failed


class Job:
    """One request on its way through the worker; events go to `events` on `loop`."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        lane: LaneKey,
        tokenizer: Any,
        stop: Sequence[str] = (),
        seed: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.lane = lane
        self.seed = seed
        self.text = CompletionText(tokenizer, stop)
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.request: DecodeRequest | None = None
        self.error: BaseException | None = None
        """what failed while handling this job's tokens"""
        self.reported = False

    def emit(self, event: JobEvent) -> None:
        """Hand an event to the handler's loop (from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the handler is gone
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def shutting_down() -> APIError:
    """The answer to a job that came, or still waited for a batch row, when the server began to stop."""
    return APIError(503, "the server is shutting down; retry against a running server", code="unavailable")


class QueueFullError(Exception):
    def __init__(self, waiting: int, limit: int) -> None:
        super().__init__(f"{waiting} requests are waiting (limit {limit})")
        self.waiting = waiting
        self.limit = limit


class SchedulerStoppedError(Exception):
    pass


# ----- the worker -----------------------------------------------------------------------------


class Scheduler:
    """Admits jobs into lanes and steps the lanes in turn, in one worker thread."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int = 8, max_queue: int = 64, metrics: ServerMetrics | None = None) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise SpecDecError(f"--max-batch-size {max_batch_size!r} must be a positive integer")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise SpecDecError(f"--max-queue {max_queue!r} must be an integer >= 0")
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        prepare = getattr(decoder, "prepare_costs", None)
        if callable(prepare):  # CAST's cost tables cover every batch size before serving: never measured mid-decode
            prepare(max_batch_size)
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition()
        # shared with the handlers (guarded by _cond)
        self._inbox: deque[Job] = deque()
        self._cancels: deque[Job] = deque()
        self._unfinished = 0
        """accepted jobs not reported yet (waiting or running)"""
        self._running_rows = 0
        """live rows over all lanes, published by the worker after each round"""
        self._lane_count = 0
        self._stopping = False
        self._deadline = 0.0
        """time.monotonic() by which a stopping worker answers whatever still runs"""
        self._thread: threading.Thread | None = None
        # owned by the worker thread
        self._waiting: deque[Job] = deque()
        self._lanes: OrderedDict[LaneKey, Lane] = OrderedDict()
        """every lane, least recently used first"""
        self._turn = 0
        self.metrics.register_gauge("specdec_queue_depth", "Requests accepted and waiting for a batch row.", lambda: float(self.queue_depth))
        self.metrics.register_gauge("specdec_running_rows", "Batch rows decoding a request, over all lanes.", lambda: float(self.running_rows))
        self.metrics.register_gauge("specdec_lanes", "Lanes (decode sessions with their own settings) holding work.", lambda: float(self.lane_count))
        self.metrics.register_gauge("specdec_max_batch_size", "Rows the server decodes at most at once (--max-batch-size).", lambda: float(self.max_batch_size))

    # ----- handler side ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-decode", daemon=True)
        self._thread.start()

    def begin_stop(self, grace_s: float = 0.0) -> None:
        """Stop taking jobs; jobs waiting for a row get 503 now, running ones get up to
        `grace_s` seconds to finish (then 503). Returns at once (see `stopped`)."""
        with self._cond:
            deadline = time.monotonic() + max(0.0, grace_s)
            self._deadline = min(self._deadline, deadline) if self._stopping else deadline
            self._stopping = True
            self._cond.notify_all()

    def stop(self, grace_s: float = 0.0, timeout: float = 30.0) -> None:
        """`begin_stop(grace_s)`, then wait (at most grace_s + timeout) for the worker to end."""
        self.begin_stop(grace_s)
        if self._thread is not None:
            self._thread.join(grace_s + timeout)

    @property
    def alive(self) -> bool:
        """The worker runs and takes jobs."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def stopped(self) -> bool:
        """The worker has ended (or never started): every job it took has had its answer."""
        return self._thread is None or not self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFullError when `max_queue` jobs already wait for a row."""
        with self._cond:
            if not self.alive:
                raise SchedulerStoppedError("the decode worker is not running")
            # at most max_batch_size jobs run, so at least max_queue wait when this holds
            if self._unfinished >= self.max_batch_size + self.max_queue:
                raise QueueFullError(max(self.max_queue, self._unfinished - self._running_rows), self.max_queue)
            self._unfinished += 1
            self._inbox.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits, free its row if it runs (at that lane's next step boundary)."""
        with self._cond:
            if job.reported:
                return
            self._cancels.append(job)
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return max(0, self._unfinished - self._running_rows)

    @property
    def running_rows(self) -> int:
        with self._cond:
            return self._running_rows

    @property
    def lane_count(self) -> int:
        with self._cond:
            return self._lane_count

    # ----- worker side -------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._waiting) or any(not lane.session.idle for lane in self._lanes.values())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._inbox and not self._cancels and not self._has_work():
                    self._cond.wait()
                stopping = self._stopping
                if stopping and (time.monotonic() >= self._deadline or not any(not lane.session.idle for lane in self._lanes.values())):
                    break
                arrived = list(self._inbox)
                self._inbox.clear()
                cancels = list(self._cancels)
                self._cancels.clear()
            try:
                self._waiting.extend(arrived)
                for job in cancels:
                    self._cancel(job)
                if cancels:
                    self._publish()  # a cancelled row is free now (its lane retires it before its next step)
                if stopping:  # draining: what has no row will not get one
                    for job in self._waiting:
                        self._fail(job, shutting_down())
                    self._waiting.clear()
                else:
                    self._admit()
                    self._publish()  # an admitted job holds its row before its first token reaches anyone
                self._step_next_lane()
            except Exception as err:  # a bug outside any one lane: fail what is in flight, keep serving
                log.exception("decode worker error")
                self._fail_everything(APIError(500, f"internal error in the decode worker: {err!r}"))
            self._publish()
        self._fail_everything(
            APIError(503, "the server shut down before this request finished; retry against a running server", code="unavailable")
        )
        self._publish()

    def _publish(self) -> None:
        # a job admitted to a lane holds a row from then on, before its prefill (`_rows_in_use`)
        running = self._rows_in_use()
        busy = sum(1 for lane in self._lanes.values() if not lane.session.idle or lane.jobs)
        with self._cond:
            self._running_rows = running
            self._lane_count = busy

    def _rows_in_use(self) -> int:
        return sum(lane.session.unfinished for lane in self._lanes.values())

    def _lane(self, key: LaneKey) -> Lane:
        lane = self._lanes.get(key)
        if lane is None:
            engine = self.decoder.make_engine(key.method, key.verify, key.verify_options)
            lane = Lane(key, engine.session(key.params, max_rows=self.max_batch_size))
            self._lanes[key] = lane
        self._lanes.move_to_end(key)
        return lane

    def _admit(self) -> None:
        """Waiting jobs take free rows (FIFO over all lanes)."""
        while self._waiting and self._rows_in_use() < self.max_batch_size:
            job = self._waiting.popleft()
            try:
                lane = self._lane(job.lane)
                job.request = lane.session.submit(job.prompt_ids, job.max_tokens, on_tokens=partial(self._on_tokens, lane, job), seed=job.seed)
                lane.jobs.append(job)
            except SpecDecError as err:
                self._fail(job, APIError(400, str(err)))
            except Exception as err:
                log.exception("could not admit a request")
                self._fail(job, APIError(500, f"internal error while admitting this request: {err!r}"))
        self._drop_idle_lanes()

    def _step_next_lane(self) -> None:
        busy = [lane for lane in self._lanes.values() if not lane.session.idle]
        if not busy:
            return
        lane = busy[self._turn % len(busy)]
        self._turn += 1
        try:
            record = lane.session.step()
        except Exception as err:
            log.exception("decode step failed in lane %s", lane.key)
            for job in list(lane.jobs):
                self._fail(job, APIError(500, f"internal error while decoding (the batch of {len(lane.jobs)} request(s) was dropped): {err!r}"))
            lane.jobs.clear()
            del self._lanes[lane.key]
            return
        if record is not None:
            active = record.active
            self.metrics.observe_step(
                lane.key.method,
                [a for a, on in zip(record.accepted_len, active, strict=True) if on],
                [d for d, on in zip(record.drafted, active, strict=True) if on],
            )
        self._report_finished(lane)
        self._drop_idle_lanes()

    def _on_tokens(self, lane: Lane, job: Job, request: DecodeRequest, tokens: list[int]) -> None:
        """A job's newly committed tokens (called inside its lane's step)."""
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        self.metrics.observe_tokens(len(tokens))
        try:
            delta = job.text.add(tokens)
        except Exception as err:
            log.exception("could not turn tokens into text")
            job.error = err
            lane.session.cancel(request, "error")
            return
        if delta:
            job.emit(TextDelta(delta))
        if job.text.stopped:
            lane.session.cancel(request, "stop")

    def _cancel(self, job: Job) -> None:
        if job.reported:
            return
        if job in self._waiting:
            self._waiting.remove(job)
            self._report(job, "cancelled")
            return
        lane = self._lanes.get(job.lane)
        if lane is not None and job.request is not None:
            lane.session.cancel(job.request, "cancelled")
            self._report_finished(lane)
            self._drop_idle_lanes()

    def _report_finished(self, lane: Lane) -> None:
        for job in [j for j in lane.jobs if j.request is not None and j.request.done]:
            lane.jobs.remove(job)
            assert job.request is not None and job.request.finish_reason is not None
            self._report(job, job.request.finish_reason)

    def _report(self, job: Job, reason: str) -> None:
        """Send a job's end to its handler and count it."""
        if job.reported:
            return
        request = job.request
        if reason == "error":
            self._fail(job, APIError(500, f"internal error while producing this request's text: {job.error!r}"))
            return
        if reason == "cancelled":
            job.emit(Failed(APIError(CLIENT_CLOSED_REQUEST, "the request was cancelled")))
            self._count_finish(job, "cancelled")
            return
        rest = job.text.finish()
        if rest:
            job.emit(TextDelta(rest))
        finish_reason = "stop" if job.text.stopped or reason == "eos" else "length"
        assert request is not None
        self._count_finish(job, finish_reason)  # before the client can see the end (and scrape /metrics)
        job.emit(
            Finished(
                text=job.text.text,
                finish_reason=finish_reason,
                prompt_tokens=len(job.prompt_ids),
                completion_tokens=job.text.token_count,
                stats=request.stats,
                lane=job.lane,
            )
        )

    def _fail(self, job: Job, error: APIError) -> None:
        if job.reported:
            return
        self._count_finish(job, "error")  # before the client can see the end (and scrape /metrics)
        job.emit(Failed(error))

    def _count_finish(self, job: Job, label: str) -> None:
        job.reported = True
        completion = job.text.token_count if job.request is not None else 0
        ttft = job.first_token_at - job.arrived if job.first_token_at is not None else None
        self.metrics.observe_finish(job.lane.method, label, len(job.prompt_ids), completion, ttft, time.perf_counter() - job.arrived)
        with self._cond:
            self._unfinished -= 1

    def _drop_idle_lanes(self) -> None:
        """Idle lanes free their caches; beyond IDLE_LANES_KEPT, the least recently used go."""
        idle = [key for key, lane in self._lanes.items() if lane.session.idle and not lane.jobs]
        for key in idle:
            self._lanes[key].session.release()
        for key in idle[: max(0, len(idle) - IDLE_LANES_KEPT)]:
            del self._lanes[key]

    def _fail_everything(self, error: APIError) -> None:
        for lane in self._lanes.values():
            for job in lane.jobs:
                self._fail(job, error)
        self._lanes.clear()
        for job in self._waiting:
            self._fail(job, error)
        self._waiting.clear()
        with self._cond:
            pending = list(self._inbox)
            self._inbox.clear()
            self._cancels.clear()
        for job in pending:
            self._fail(job, error)
