"""`specdec bench-serve`: the OpenAI-compatible server under concurrent clients, per method.

Protocol
- The target, draft and tokenizer are loaded once; each `--methods` item gets its own
  decoder over them and its own server (`specdec.serve.create_app`), started in-process on a
  free port, one method at a time (the server's default method is the item's).
- Each server gets one unmeasured warm-up request, then, for each `--concurrency` C, C client
  threads each send `--requests-per-client` streaming /v1/completions requests one after the
  other (prompt i of client c: the set's prompt (c * R + i) mod N, the same for every method).
- Per request: TTFT (send -> first chunk with text), TPOT ((last chunk - first chunk) /
  (completion tokens - 1)), latency, completion tokens (the stream's usage chunk).
  Per level: throughput = completion tokens of all requests / wall time of the level.
- The server's `--max-batch-size` is the largest concurrency unless given, so every client
  of a level holds a row; the queue is large enough that nothing gets 429.
Clients use the standard library (`http.client`), so the package needs no HTTP client.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specdec.api import SpeculativeDecoder, needs_draft_model
from specdec.bench.config import PairRunConfig
from specdec.bench.defaults import DEFAULT_CONCURRENCY as DEFAULT_CONCURRENCY  # re-exported
from specdec.bench.defaults import SERVE_METHODS
from specdec.bench.pair import load_pair, pair_paths
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.bench.variants import BASELINE, Variant, make_variants
from specdec.errors import SpecDecError
from specdec.methods import POLICY_CLASSES, method_uses_draft
from specdec.parsing import check_max_draft_rows

DEFAULT_METHODS = SERVE_METHODS
WARMUP_TOKENS = 8
REQUEST_TIMEOUT_S = 600.0


@dataclass
class ServeBenchConfig(PairRunConfig):
    """Everything that defines a bench-serve run (saved in results.json): the prompts and pair
    fields of `PairRunConfig`, and these."""

    methods: list[str] = field(default_factory=lambda: DEFAULT_METHODS.split(","))
    """`--methods` items (same syntax as `specdec bench`: METHOD[@RULE][:NAME=VALUE,...])"""
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    requests_per_client: int = 4
    max_tokens: int = 64
    temperature: float = 0.0
    max_batch_size: int | None = None
    """the server's --max-batch-size (default: the largest concurrency)"""
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    mars_theta: float | None = None
    verify: str = "auto"
    decoder_options: dict[str, Any] = field(default_factory=dict)
    """further `SpeculativeDecoder` arguments of every method (draft_source, lookup_ngram, ...)"""


@dataclass
class RequestRecord:
    client: int
    prompt_index: int
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    latency_s: float = 0.0
    completion_tokens: int = 0
    text: str = ""


@dataclass
class LevelResult:
    """One method at one concurrency."""

    label: str
    method: str
    verify: str
    concurrency: int
    requests: int
    failed: int
    completion_tokens: int
    wall_s: float
    throughput_tok_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    tpot_ms_p50: float
    tpot_ms_p90: float
    latency_ms_p50: float
    latency_ms_p90: float
    speedup_vs_ar: float | None = None
    """throughput over AR's at the same concurrency (None without an AR run)"""
    matches_ar: float | None = None
    """share of this level's completions equal to AR's for the same prompt (greedy only)"""
    errors: list[str] = field(default_factory=list)


@dataclass
class ServeBenchOutputs:
    levels: list[LevelResult]
    report: Path
    results: Path
    plot: Path


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ----- one client request ------------------------------------------------------------------


def stream_completion(base_url: str, body: dict[str, Any], client: int = 0, prompt_index: int = 0) -> RequestRecord:
    """POST a streaming /v1/completions request and time it (standard library only)."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=REQUEST_TIMEOUT_S)
    record = RequestRecord(client=client, prompt_index=prompt_index, ok=False)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    first = last = None
    texts: list[str] = []
    try:
        conn.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            record.error = f"HTTP {response.status}: {response.read().decode('utf-8', 'replace')[:300]}"
            return record
        while True:
            line = response.readline()
            if not line:
                record.error = "the stream ended without [DONE]"
                return record
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = str(chunk["error"].get("message"))
                return record
            if chunk.get("usage"):
                record.completion_tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    texts.append(choice["text"])
    except (OSError, http.client.HTTPException, ValueError) as err:
        record.error = f"{type(err).__name__}: {err}"
        return record
    finally:
        conn.close()
    end = time.perf_counter()
    record.ok = True
    record.text = "".join(texts)
    record.latency_s = end - t0
    record.ttft_s = (first if first is not None else end) - t0
    if first is not None and last is not None and record.completion_tokens > 1:
        record.tpot_s = (last - first) / (record.completion_tokens - 1)
    return record


def run_level(base_url: str, prompts: Sequence[str], concurrency: int, requests_per_client: int, body: dict[str, Any]) -> tuple[list[RequestRecord], float]:
    """`concurrency` client threads, each sending its requests one after the other; returns the records and the wall time."""
    records: list[RequestRecord] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests_per_client):
            index = (c * requests_per_client + i) % len(prompts)
            record = stream_completion(base_url, {**body, "prompt": prompts[index]}, client=c, prompt_index=index)
            with lock:
                records.append(record)

    threads = [threading.Thread(target=client, args=(c,), name=f"bench-client-{c}") for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def summarize_level(variant: Variant, concurrency: int, records: Sequence[RequestRecord], wall_s: float) -> LevelResult:
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ms = 1e3
    return LevelResult(
        label=variant.label,
        method=variant.method,
        verify=variant.verify or "",
        concurrency=concurrency,
        requests=len(records),
        failed=len(records) - len(ok),
        completion_tokens=tokens,
        wall_s=wall_s,
        throughput_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_ms_p50=percentile([r.ttft_s for r in ok], 50) * ms,
        ttft_ms_p90=percentile([r.ttft_s for r in ok], 90) * ms,
        tpot_ms_p50=percentile([r.tpot_s for r in ok if r.completion_tokens > 1], 50) * ms,
        tpot_ms_p90=percentile([r.tpot_s for r in ok if r.completion_tokens > 1], 90) * ms,
        latency_ms_p50=percentile([r.latency_s for r in ok], 50) * ms,
        latency_ms_p90=percentile([r.latency_s for r in ok], 90) * ms,
        errors=sorted({r.error for r in records if not r.ok})[:5],
    )


# ----- the run -----------------------------------------------------------------------------


def _fitting_prompts(decoder: SpeculativeDecoder, texts: Sequence[str], max_tokens: int) -> list[str]:
    """Prompts that fit the context with max_tokens, counted as the server counts them
    (`decoder.encode`, so with the special tokens the tokenizer adds, e.g. a BOS); a longer
    prompt keeps its last tokens."""
    limit = decoder.max_context
    if limit is None:
        return list(texts)
    room = limit - max_tokens
    if room < 1:
        raise SpecDecError(f"--max-tokens {max_tokens} leaves no room for a prompt in the model's context of {limit} tokens; lower it")
    fitting = [trimmed for trimmed in (_last_tokens(decoder, text, room) for text in texts) if trimmed is not None]
    if not fitting:
        raise SpecDecError(f"no prompt fits the model's context of {limit} tokens with --max-tokens {max_tokens}; lower --max-tokens")
    return fitting


def _last_tokens(decoder: SpeculativeDecoder, text: str, room: int) -> str | None:
    """`text`, or the end of it that the server counts as at most `room` tokens (None: none does)."""
    total = len(decoder.encode(text))
    if total <= room:
        return text
    content = decoder.tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = room - (total - len(content))  # the tokens the tokenizer adds (a BOS) take room too
    while keep > 0:
        # a cut inside a character decodes to U+FFFD: drop it; text re-tokenized across the cut may take more tokens
        trimmed = decoder.tokenizer.decode(content[-keep:]).lstrip("\ufffd")
        count = len(decoder.encode(trimmed)) if trimmed.strip() else room + 1
        if count <= room:
            return trimmed
        keep -= max(1, count - room)
    return None


FILES_PER_CLIENT = 2
"""open files a concurrent client costs this process: its socket and the in-process server's end of it"""
FILES_SPARE = 256
"""open files kept for everything else (model files, the listening socket, the event loop, libraries)"""


def check_open_files(concurrency: int) -> None:
    """A SpecDecError when `concurrency` clients would run this process out of file descriptors
    (`ulimit -n`): the run would fail with "Too many open files" part way, and hang."""
    try:
        import resource
    except ImportError:  # not on POSIX: no limit to check
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    most = max(0, (soft - FILES_SPARE) // FILES_PER_CLIENT)
    if concurrency > most:
        raise SpecDecError(
            f"--concurrency {concurrency} needs about {FILES_PER_CLIENT * concurrency + FILES_SPARE} open files, beyond this shell's limit of {soft} "
            f"(ulimit -n); use --concurrency {most} or less, or raise the limit"
        )


def check_config(config: ServeBenchConfig) -> list[Variant]:
    """Validate everything cheap before any model loads; returns the variants."""
    if not isinstance(config.requests_per_client, int) or config.requests_per_client < 1:
        raise SpecDecError(f"--requests-per-client {config.requests_per_client!r} must be a positive integer")
    if not isinstance(config.max_tokens, int) or config.max_tokens < 1:
        raise SpecDecError(f"--max-tokens {config.max_tokens!r} must be a positive integer")
    if not 0 <= config.temperature <= 2:
        raise SpecDecError(f"--temperature {config.temperature} must be in [0, 2]")
    if config.max_batch_size is not None and config.max_batch_size < 1:
        raise SpecDecError(f"--max-batch-size {config.max_batch_size} must be a positive integer")
    if not config.concurrency or any(c < 1 for c in config.concurrency):
        raise SpecDecError(f"--concurrency {config.concurrency} must be positive integers, e.g. 1,2,4,8,16")
    check_open_files(max(config.concurrency))
    check_max_draft_rows(config.decoder_options.get("max_draft_rows"))
    unknown = [m for m in config.methods if m.split("@")[0].split(":")[0] not in POLICY_CLASSES]
    if unknown:
        raise SpecDecError(f"--methods {', '.join(unknown)}: bench-serve runs the engine's methods only ({', '.join(POLICY_CLASSES)})")
    return make_variants(config.methods, [config.verify], config.temperature, config.method_options, mars_theta=config.mars_theta)


def run_serve_bench(config: ServeBenchConfig, argv: Sequence[str] = (), progress: bool = True) -> ServeBenchOutputs:
    """Run every method's server at every concurrency; write report.md, results.json and serve.png into `config.out`."""
    from specdec.serve import BackgroundServer, create_app

    variants = check_config(config)
    items = load_prompts(resolve_prompt_source(config.prompts), config.num_prompts)
    texts = [p.turns[0] for p in items if not p.images]
    if not texts:
        raise SpecDecError(f"--prompts {config.prompts!r} has no text-only prompt; the server takes text prompts only")
    target_path, draft_path = pair_paths(config)
    needs_draft = any(needs_draft_model(v.method, config.decoder_options.get("draft_source", "model")) for v in variants)
    if needs_draft and draft_path is None:
        raise SpecDecError("--methods include a drafting method but no draft model was given; pass --draft PATH or use --methods ar")
    pair = load_pair(config, target_path, draft_path if needs_draft else None)
    target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
    device = target.device

    max_batch = config.max_batch_size or max(config.concurrency)
    body = {"max_tokens": config.max_tokens, "temperature": config.temperature}
    levels: list[LevelResult] = []
    texts_by_level: dict[tuple[str, int], dict[int, str]] = {}
    prompts: list[str] = []
    for v in variants:
        uses_draft = method_uses_draft(v.method)
        decoder = SpeculativeDecoder(
            target, tokenizer, draft if uses_draft else None, method=v.method, verify=v.verify, verify_options=v.rule_options,
            **config.decoder_options, **v.options,
        )
        prompts = prompts or _fitting_prompts(decoder, texts, config.max_tokens)
        app = create_app(decoder, max_batch_size=max_batch, max_queue=max(config.concurrency) * 2)
        with BackgroundServer(app) as server:
            warm = stream_completion(server.url, {**body, "prompt": prompts[0], "max_tokens": min(WARMUP_TOKENS, config.max_tokens)})
            if not warm.ok:
                raise SpecDecError(f"the {v.label} server failed its warm-up request: {warm.error}")
            for c in config.concurrency:
                records, wall = run_level(server.url, prompts, c, config.requests_per_client, body)
                level = summarize_level(v, c, records, wall)
                levels.append(level)
                texts_by_level[(v.label, c)] = {r.prompt_index: r.text for r in records if r.ok}
                if progress:
                    print(
                        f"{v.label:>12} C={c:<3} {level.throughput_tok_s:8.1f} tok/s  TTFT p50 {level.ttft_ms_p50:7.1f} ms  "
                        f"TPOT p50 {level.tpot_ms_p50:6.1f} ms  failed {level.failed}",
                        flush=True,
                    )
    _compare_to_ar(levels, texts_by_level, config.temperature == 0)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_serve(levels, out / "serve.png")
    results = out / "results.json"
    results.write_text(json.dumps(results_dict(config, levels, argv, [plot.name], device, max_batch), indent=2) + "\n", encoding="utf-8")
    report = out / "report.md"
    report.write_text(render_markdown(config, levels, argv, plot.name, device, max_batch, len(prompts)), encoding="utf-8")
    return ServeBenchOutputs(levels=levels, report=report, results=results, plot=plot)


def _compare_to_ar(levels: Sequence[LevelResult], texts: dict[tuple[str, int], dict[int, str]], greedy: bool) -> None:
    ar = {level.concurrency: level for level in levels if level.label == BASELINE}
    for level in levels:
        base = ar.get(level.concurrency)
        if base is None:
            continue
        level.speedup_vs_ar = level.throughput_tok_s / base.throughput_tok_s if base.throughput_tok_s else None
        if greedy:
            mine, theirs = texts.get((level.label, level.concurrency), {}), texts.get((BASELINE, level.concurrency), {})
            common = [i for i in mine if i in theirs]
            level.matches_ar = sum(mine[i] == theirs[i] for i in common) / len(common) if common else None


# ----- outputs -----------------------------------------------------------------------------


def results_dict(
    config: ServeBenchConfig, levels: Sequence[LevelResult], argv: Sequence[str], plots: Sequence[str], device: Any, max_batch: int
) -> dict[str, Any]:
    from specdec.bench.report import command_line, machine_info, versions

    return {
        "command": command_line(argv),
        "config": asdict(config),
        "server": {"max_batch_size": max_batch, "max_queue": max(config.concurrency) * 2},
        "machine": machine_info(str(device)),
        "versions": versions(),
        "levels": [asdict(level) for level in levels],
        "plots": list(plots),
    }


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def render_markdown(
    config: ServeBenchConfig, levels: Sequence[LevelResult], argv: Sequence[str], plot: str, device: Any, max_batch: int, n_prompts: int
) -> str:
    from specdec.bench.report import command_line, machine_info, versions

    machine = machine_info(str(device))
    vers = versions()
    lines = [
        "# specdec bench-serve",
        "",
        f"- **Command**: `{command_line(argv)}`",
        f"- **Machine**: {machine['cpu']}, {machine['logical_cores']} logical cores, {machine['memory_gb']} GB RAM, "
        f"torch threads {machine['torch_threads']}, device {device}" + (f" ({machine['gpu']})" if "gpu" in machine else ""),
        "- **Versions**: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        f"- **Load**: concurrency {', '.join(map(str, config.concurrency))}; each client sends {config.requests_per_client} streaming "
        f"/v1/completions requests one after another; {config.max_tokens} max tokens, temperature {config.temperature:g}; "
        f"{n_prompts} prompts from `{config.prompts}`; server --max-batch-size {max_batch}"
        + (f", --max-draft-rows {rows} (steps with more active rows draft nothing)" if (rows := config.decoder_options.get("max_draft_rows")) is not None else ""),
        "- **Figures**: throughput = completion tokens / wall time of the level; TTFT = request sent -> first text chunk; "
        "TPOT = (last chunk - first chunk) / (tokens - 1); p50/p90 over the level's requests; speedup = throughput / AR's at the same concurrency",
        "",
        "| method | C | tok/s | speedup vs AR | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | latency p50 (ms) | failed | = AR |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for level in sorted(levels, key=lambda x: (x.concurrency, x.label != BASELINE, x.label)):
        lines.append(
            f"| `{level.label}` | {level.concurrency} | {level.throughput_tok_s:.1f} | {_fmt(level.speedup_vs_ar, '.2f', 'x')} | "
            f"{level.ttft_ms_p50:.1f} / {level.ttft_ms_p90:.1f} | {level.tpot_ms_p50:.1f} / {level.tpot_ms_p90:.1f} | "
            f"{level.latency_ms_p50:.0f} | {level.failed}/{level.requests} | {_fmt(None if level.matches_ar is None else 100 * level.matches_ar, '.0f', '%')} |"
        )
    failures = [level for level in levels if level.failed]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- `{level.label}` C={level.concurrency}: {'; '.join(level.errors)}" for level in failures]
    lines += ["", f"![throughput, latency and speedup vs concurrency]({plot})", ""]
    best = _best_speedups(levels)
    if best:
        lines += ["## Summary", "", *best, ""]
    return "\n".join(lines)


def _best_speedups(levels: Sequence[LevelResult]) -> list[str]:
    out = []
    for label in dict.fromkeys(level.label for level in levels if level.label != BASELINE):
        mine = [level for level in levels if level.label == label and level.speedup_vs_ar is not None]
        if mine:
            speedups = ", ".join(f"C={level.concurrency}: {level.speedup_vs_ar:.2f}x" for level in mine)
            out.append(f"- `{label}` throughput over AR: {speedups} (median {statistics.median(level.speedup_vs_ar or 0 for level in mine):.2f}x)")
    return out


def plot_serve(levels: Sequence[LevelResult], path: Path) -> Path:
    """Four panels against concurrency: throughput, speedup over AR, TTFT p50/p90, TPOT p50/p90."""
    from specdec.bench.plots import pyplot, save_figure

    plt = pyplot()

    labels = list(dict.fromkeys(level.label for level in levels))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "throughput (tok/s)", [("throughput_tok_s", "-")]),
        (axes[0][1], "speedup over AR (x)", [("speedup_vs_ar", "-")]),
        (axes[1][0], "TTFT (ms): p50 solid, p90 dashed", [("ttft_ms_p50", "-"), ("ttft_ms_p90", "--")]),
        (axes[1][1], "TPOT (ms): p50 solid, p90 dashed", [("tpot_ms_p50", "-"), ("tpot_ms_p90", "--")]),
    ]
    for ax, title, series in panels:
        for i, label in enumerate(labels):
            mine = sorted((level for level in levels if level.label == label), key=lambda x: x.concurrency)
            color = f"C{i}"
            for attr, style in series:
                points = [(level.concurrency, getattr(level, attr)) for level in mine if getattr(level, attr) is not None]
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", color=color, label=label if style == "-" else None)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if title.startswith("speedup"):
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no AR run to compare with", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("specdec serve: per method against concurrency")
    return save_figure(fig, path)
