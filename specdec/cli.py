"""The `specdec` command: generate, serve, bench, bench-serve, sweep, train, profile, synth-pair.

Building the parser imports nothing heavy (`specdec --help` starts in well under a second);
torch, transformers and the optional extras are imported inside the commands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.bundled import bundled_lvlm_draft, bundled_lvlm_target
from specdec.errors import SpecDecError
from specdec.extras import require
from specdec.method_flags import method_flags
from specdec.names import METHOD_NAMES
from specdec.parsing import check_seed, parse_int_list
from specdec.paths import folder_write_problem

if TYPE_CHECKING:
    from specdec.api import SpeculativeDecoder
    from specdec.bench.runner import BenchConfig

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse's own errors already exit with status 2 and no traceback; kept as a hook."""


def _model_name(flag: str) -> Callable[[str], str]:
    """argparse type of --target/--draft: an empty name is an error (not the bundled model)."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{flag} is empty; give a model folder or hub id, or leave {flag} out for the bundled pair's model")
        return value

    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target/--draft/--device/--dtype (the bundled pair by default) and the loading options."""
    p.add_argument("--target", default=None, type=_model_name("--target"), help="target model: local folder or hub id (default: the bundled pair's target)")
    p.add_argument("--draft", default=None, type=_model_name("--draft"), help="draft model sharing the target's tokenizer (default: the bundled pair's draft)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto (float32 on CPU, bfloat16 on CUDA)")
    g = p.add_argument_group("loading (from_pretrained options)")
    g.add_argument(
        "--device-map", default=None,
        help="place both models with accelerate instead of --device: auto, balanced, balanced_low_0, sequential or a device such as cuda:1 (needs accelerate)",
    )
    g.add_argument(
        "--quantization", default=None, metavar="4bit|8bit",
        help="quantize the target with bitsandbytes while loading (needs bitsandbytes, accelerate and a GPU); pre-quantized checkpoints load quantized without it",
    )
    g.add_argument("--draft-quantization", default=None, metavar="4bit|8bit", help="quantize the draft with bitsandbytes while loading")
    g.add_argument("--attn-implementation", default=None, metavar="eager|sdpa", help="attention kernel of both models (default: transformers' choice); flash attention cannot take tree masks")
    g.add_argument("--revision", default=None, help="hub branch, tag or commit of --target (hub ids only)")
    g.add_argument("--draft-revision", default=None, help="hub branch, tag or commit of --draft (hub ids only)")
    g.add_argument("--trust-remote-code", action="store_true", help="run modelling code shipped with a checkpoint (only for checkpoints you trust)")


def add_graphs_arg(p: argparse.ArgumentParser) -> None:
    """--cuda-graphs, for the commands that run decoding forwards."""
    p.add_argument(
        "--cuda-graphs", default="auto", choices=("auto", "on", "off"),
        help="capture the draft and verify forwards as CUDA graphs per batch size and node-count bucket: auto (default: on for CUDA, off elsewhere), on (needs CUDA), off",
    )


def add_draft_rows_arg(p: argparse.ArgumentParser) -> None:
    """--max-draft-rows, for the commands that decode batches."""
    p.add_argument(
        "--max-draft-rows", type=int, default=None, metavar="N",
        help="a step with more than N active rows drafts nothing: the target alone decodes one token a row, as AR "
        "(speculation pays at small batches and loses once the batch fills the device; find N with bench --batch-sizes). Default: no limit",
    )


def check_graphs_arg(args: argparse.Namespace) -> None:
    """`--cuda-graphs on` with a device that is not CUDA: a one-line error before loading."""
    from specdec.models.graphs import check_cuda_graphs

    check_cuda_graphs(args.cuda_graphs, args.device)


def load_kwargs(args: argparse.Namespace) -> dict:
    """The loading flags as `SpeculativeDecoder.from_pretrained` keywords."""
    return {
        "device_map": args.device_map, "quantization": args.quantization, "draft_quantization": args.draft_quantization,
        "attn_implementation": args.attn_implementation, "revision": args.revision, "draft_revision": args.draft_revision,
        "trust_remote_code": args.trust_remote_code,
    }


def pair_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `add_model_args` flags as `specdec.bench.config.PairRunConfig` fields."""
    return {"target": args.target, "draft": args.draft, "device": args.device, "dtype": args.dtype, "load_options": load_kwargs(args)}


def _on_off(text: str) -> bool:
    """'on'/'off' (also true/false, yes/no, 1/0) -> bool, for switch-like method options."""
    value = text.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not on or off")


def add_method_args(
    p: argparse.ArgumentParser, multi: bool = False, methods_default: str = "ar,chain,static,eagle2", extra_methods: Sequence[str] = ()
) -> None:
    """--method/--verify and every method option (each applies to the methods that take it).

    multi: --methods LIST (default `methods_default`; `extra_methods` are further accepted names, e.g. bench peers).
    """
    names = ", ".join(METHOD_NAMES)
    if multi:
        p.add_argument(
            "--methods",
            default=methods_default,
            help=f"comma-separated methods ({', '.join([*METHOD_NAMES, *extra_methods])}; default {methods_default}); "
            "an item may carry its own options and accept rule: METHOD[@RULE][:NAME=VALUE,...], e.g. "
            "chain:k=3,dynatree:phase=0,static:depth=5,branching=2,chain@mars:theta=0.85 "
            "(option names are the method's fields; an item's options override the global flags below; "
            "its label in the report is e.g. chain[k=3], chain/mars[theta=0.85])",
        )
        p.add_argument("--verify", default="auto", help="comma-separated accept rules: greedy, sampling, mars or auto (by temperature)")
    else:
        p.add_argument("--method", default="chain", help=f"one of {names} (default chain)")
        p.add_argument("--verify", default="auto", help="greedy, sampling, mars (margin-aware, lossy), or auto: greedy at temperature 0, sampling above")
    p.add_argument(
        "--mars-theta", type=float, default=None, help="--verify mars: logit-ratio threshold theta > 0 (default 0.9); theta >= 1 disables the relaxation"
    )
    p.add_argument(
        "--draft-source", default="model",
        help="model (the draft model, default), lookup (n-gram prompt lookup: no draft model) or tabed (an adaptive ensemble of --views of the draft)",
    )
    # defaults None: `apply_draft_source_flags` fills in DRAFT_SOURCE_FLAGS' defaults and rejects a flag set for another source
    p.add_argument("--lookup-ngram", type=int, default=None, help="lookup: longest n-gram matched (3)")
    p.add_argument("--views", default=None, help="tabed: drafting views, from M (image+text), T (text only), C (caption), P (pooled image), tailN (last N tokens); default M,T")
    p.add_argument("--tabed-policy", default=None, help="tabed: weight policy grid (default), softmax, static, random or fixed")
    p.add_argument("--tabed-distance", default=None, help="tabed: kl (default), tv or hard")
    p.add_argument("--tabed-window", default=None, help="tabed: past positions scored (a positive integer, or all)")
    p.add_argument("--tabed-prior", type=_on_off, default=None, metavar="on|off", help="tabed: start each prompt from earlier prompts' evidence (on)")
    g = p.add_argument_group("method options (defaults: each method's own)")
    for spec in method_flags():
        kind = {"int": int, "float": float, "str": str, "bool": _on_off}[spec.type]
        extra = {"metavar": "on|off"} if spec.type == "bool" else {}
        g.add_argument(spec.flag, dest=spec.dest, type=kind, default=None, help=spec.help(), **extra)


DRAFT_SOURCE_FLAGS: dict[str, tuple[str, object]] = {
    "lookup_ngram": ("lookup", 3),
    "views": ("tabed", "M,T"),
    "tabed_policy": ("tabed", "grid"),
    "tabed_distance": ("tabed", "kl"),
    "tabed_window": ("tabed", "all"),
    "tabed_prior": ("tabed", True),
}
"""argparse dest -> (the --draft-source it configures, its default)"""


def apply_draft_source_flags(args: argparse.Namespace) -> None:
    """Fill in the draft-source flags' defaults; a flag set for another --draft-source is an
    error (it would be silently ignored)."""
    for dest, (source, default) in DRAFT_SOURCE_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif args.draft_source != source:
            flag = "--" + dest.replace("_", "-")
            raise SpecDecError(f"{flag} applies only to --draft-source {source} (got --draft-source {args.draft_source}); drop {flag} or add --draft-source {source}")


def collect_method_options(args: argparse.Namespace, method: str, strict: bool = True) -> dict:
    """The method options the user set that apply to `method` (strict: an inapplicable one is an error)."""
    from specdec.methods import method_options

    allowed = set(method_options(method))
    chosen = {}
    for spec in method_flags():
        value = getattr(args, spec.dest, None)
        if value is None:
            continue
        if spec.field in allowed:
            chosen[spec.field] = value
        elif strict:
            raise SpecDecError(f"{spec.flag} does not apply to --method {method}; it takes {', '.join(sorted(allowed)) or 'no options'}")
    return chosen


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k filter (0 = off)")
    p.add_argument(
        "--seed", type=int, default=None,
        help="seeds sampling (0 to 2**64-1); the same prompts, order and --batch-size reproduce the output, but a prompt's sampled text "
        "depends on the prompts batched with it",
    )


def note_greedy_filters(args: argparse.Namespace) -> None:
    """A note on stderr when --top-k/--top-p are set at --temperature 0, where decoding is greedy
    and they change nothing (not an error: greedy is their limit, as in transformers' generate)."""
    from specdec.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_p, args.top_k)  # a bad value is an error, before any note
    if args.temperature != 0:
        return
    unused = [f"--top-k {args.top_k}"] if args.top_k else []
    unused += [f"--top-p {args.top_p}"] if args.top_p != 1.0 else []
    if unused:
        verb, pronoun = ("filters", "it") if len(unused) == 1 else ("filter", "them")
        print(f"specdec: note: {' and '.join(unused)} only {verb} sampling; at --temperature 0 decoding is greedy and ignores {pronoun}", file=sys.stderr)


def read_prompt_file(name: str) -> str:
    """A --prompt-file's text (UTF-8), with one-line errors for what can go wrong."""
    path = Path(name).expanduser()
    if path.is_dir():
        raise SpecDecError(f"--prompt-file {name!r} is a directory; give a text file")
    if not path.exists():
        raise SpecDecError(f"--prompt-file {name!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SpecDecError(f"--prompt-file {name!r} is not UTF-8 text (byte {err.start}: {err.reason}); convert it, e.g. iconv -t UTF-8 {name}") from None
    except OSError as err:
        raise SpecDecError(f"--prompt-file {name!r} cannot be read ({err.strerror or err}); check its permissions") from None
    if not text.strip("\r\n"):  # spaces are text to continue, as with --prompt "  "; line breaks alone are an empty file
        raise SpecDecError(f"--prompt-file {name!r} is empty; give a file with the text to continue")
    return text


def check_out_dir(out: str, flag: str = "--out") -> None:
    """An output folder: may exist (files in it are replaced), must not be a file, and must be
    one that can be created and written to. Checked before any work."""
    if not out.strip():
        raise SpecDecError(f"{flag} is empty; give an output folder, e.g. {flag} runs/out")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise SpecDecError(f"{flag} {out!r} is an existing file, but it names an output folder; give a folder path")
    existed = path.is_dir()
    problem = folder_write_problem(path)
    if problem is not None:
        raise SpecDecError(f"{flag} {out!r}: cannot {'write in' if existed else 'create'} the folder ({problem}); give a writable folder")


def check_out_file(out: str, flag: str = "--out", example: str = "cost_profile.json") -> None:
    """An output file: must not be a folder, and its folder must be one that can be created
    and written to. Checked before any work."""
    if not out.strip():
        raise SpecDecError(f"{flag} is empty; give an output file path such as {example}")
    path = Path(out).expanduser()
    if path.is_dir():
        raise SpecDecError(f"{flag} {out!r} is a directory, but it names an output file; give a file path such as {Path(out) / example}")
    problem = folder_write_problem(path.parent)
    if problem is not None:
        raise SpecDecError(f"{flag} {out!r}: cannot create the file there ({problem}); give a path in a writable folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise SpecDecError(f"{flag} {out!r} exists and cannot be written (permission denied); give another path or make it writable")


def ensemble_options(args: argparse.Namespace) -> dict:
    """--tabed-* flags as EnsembleConfig fields."""
    window = args.tabed_window
    if window != "all":
        try:
            window = int(window)
        except ValueError:
            raise SpecDecError(f"--tabed-window {window!r} must be a positive integer or 'all'") from None
    return {"policy": args.tabed_policy, "distance": args.tabed_distance, "window": None if window == "all" else window, "prior": args.tabed_prior}


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="continue a prompt with speculative decoding")
    add_model_args(gen)
    add_graphs_arg(gen)
    add_draft_rows_arg(gen)
    add_method_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="the text to continue (repeat for several prompts)")
    gen.add_argument("--prompt-file", action="append", default=[], help="read a prompt from this file (repeat for several)")
    gen.add_argument(
        "--batch-size", type=int, default=None,
        help="with several prompts: rows decoded together (default: all of them); a finished row takes the next prompt",
    )
    gen.add_argument(
        "--image", action="append", default=[],
        help="an image for a vision-language target (repeat for several; one <image> in the prompt per image); without --target the bundled LVLM pair is used",
    )
    gen.add_argument(
        "--chat", action="store_true",
        help="instruct models: each prompt is a user message, sent through the tokenizer's chat template (with the generation prompt); only the reply is printed",
    )
    gen.add_argument("--system", default=None, metavar="TEXT", help="a system message before each prompt (implies --chat)")
    gen.add_argument(
        "--stop", action="append", default=[], metavar="STR",
        help="end a prompt's text just before this string (repeat for several; finish_reason 'stop'); the row stops decoding there",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON line: text, token_ids, finish_reason, stats")
    gen.add_argument("--stream", action="store_true", help="print the text as it is committed (never past a --stop string)")
    gen.set_defaults(func=_cmd_generate)


JSON_STATS = ("tau", "acceptance_rate", "tokens_per_s", "steps", "ttft_ms", "tpot_ms")
"""the stats `generate --json` prints per prompt"""


def _note_unused_draft_flags(args: argparse.Namespace) -> None:
    """A note on stderr for `generate`'s --draft and --verify mars where nothing is drafted from a
    draft model (not an error: a script may pass the same flags to every method), so a flag is
    never dropped without a word (a mistyped --draft path is not even read there)."""
    from specdec.api import DRAFT_SOURCES, method_uses_draft, needs_draft_model
    from specdec.methods import POLICY_CLASSES

    if args.method not in POLICY_CLASSES or args.draft_source not in DRAFT_SOURCES:
        return  # reported with the choices when the decoder is built
    if args.draft is not None and not needs_draft_model(args.method, args.draft_source):
        why = "--method ar drafts nothing" if not method_uses_draft(args.method) else f"--draft-source {args.draft_source} drafts without a draft model"
        print(f"specdec: note: --draft {args.draft!r} is not read: {why}", file=sys.stderr)
    if args.verify == "mars" and not method_uses_draft(args.method):
        print("specdec: note: --verify mars changes nothing here: it relaxes how drafted tokens are accepted, and --method ar drafts none", file=sys.stderr)


def _decoder_for(args: argparse.Namespace, target: str | None, draft: str | None) -> SpeculativeDecoder:
    """The decoder `generate` asked for (method, rule, draft source and their options)."""
    from specdec.api import SpeculativeDecoder

    options = collect_method_options(args, args.method)
    if args.mars_theta is not None and args.verify != "mars":
        raise SpecDecError(f"--mars-theta applies only to --verify mars (got --verify {args.verify})")
    check_graphs_arg(args)
    return SpeculativeDecoder.from_pretrained(
        target, draft, method=args.method, verify=args.verify, device=args.device, dtype=args.dtype, mars_theta=args.mars_theta,
        draft_source=args.draft_source, lookup_ngram=args.lookup_ngram, views=args.views, ensemble_options=ensemble_options(args),
        cuda_graphs=args.cuda_graphs, max_draft_rows=args.max_draft_rows, **load_kwargs(args), **options,
    )


def _prompt_kwargs(args: argparse.Namespace, decoder: SpeculativeDecoder, prompts: list[str]) -> dict[str, Any]:
    """`SpeculativeDecoder.generate` keywords for the prompts: `prompt=` text, or with --chat
    `messages=` (each prompt one user message, --system first), and --stop."""
    stop = {"stop": list(args.stop)} if args.stop else {}
    if not args.chat:
        return {"prompt": prompts[0] if len(prompts) == 1 else prompts, **stop}
    from specdec.text import check_chat_template

    check_chat_template(decoder.tokenizer, decoder.model_name, "--chat")
    chats = [[{"role": "user", "content": p}] for p in prompts]
    return {"messages": chats[0] if len(chats) == 1 else chats, "system": args.system, **stop}


def _json_line(result: Any, index: int | None = None) -> str:
    stats = result.stats.summary()
    line = {"prompt_index": index} if index is not None else {}
    line |= {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": {k: stats[k] for k in JSON_STATS}}
    return json.dumps(line)


def _generate_many(args: argparse.Namespace, prompts: list[str]) -> int:
    """Several prompts, `--batch-size` rows decoded together: each prompt's text (or one JSON
    line per prompt, in the order given), then a summary on stderr."""
    decoder = _decoder_for(args, args.target, args.draft)
    started = time.perf_counter()
    results = decoder.generate(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        batch_size=args.batch_size, **_prompt_kwargs(args, decoder, prompts),
    )
    wall = time.perf_counter() - started
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        if args.json:
            print(_json_line(result, index))
        else:
            print(f"--- prompt {index + 1} of {len(prompts)} ---")
            print(result.text if args.chat else prompt + result.text)
    tokens = sum(len(r.token_ids) for r in results)
    rows = min(args.batch_size or len(prompts), len(prompts))
    print(f"[{args.method}] {len(prompts)} prompts, batch size {rows}: {tokens} tokens in {wall:.2f} s, {tokens / max(wall, 1e-9):.1f} tok/s over the batch", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt and not args.prompt_file:
        raise SpecDecError("give the text to continue with --prompt TEXT or --prompt-file PATH")
    prompts = list(args.prompt) + [read_prompt_file(name) for name in args.prompt_file]
    check_seed(args.seed)
    if args.system is not None:
        args.chat = True
    if args.chat and args.image:
        raise SpecDecError("--chat and --image do not go together yet; write the prompt in the model's own format with its <image> placeholders and drop --chat")
    if any(not s for s in args.stop):
        raise SpecDecError("--stop needs a non-empty string")
    if args.image:
        require("PIL", "vision", "--image")
    if args.batch_size is not None and args.batch_size < 1:
        raise SpecDecError(f"--batch-size {args.batch_size} must be a positive integer")
    if args.stream and args.json:
        raise SpecDecError("--stream prints the text as it comes and --json one JSON object at the end; give one of them")
    _note_unused_draft_flags(args)
    if len(prompts) > 1:
        if args.image:
            raise SpecDecError(f"--image goes with one prompt, got {len(prompts)} prompts; generate them one at a time")
        if args.stream:
            raise SpecDecError(f"--stream shows one prompt's text as it comes, got {len(prompts)} prompts; drop --stream")
        return _generate_many(args, prompts)
    prompt = prompts[0]
    target, draft = args.target, args.draft
    if args.image and target is None:  # images: the bundled vision-language pair
        target, draft = bundled_lvlm_target(), draft or bundled_lvlm_draft()
    decoder = _decoder_for(args, target, draft)
    kwargs = _prompt_kwargs(args, decoder, prompts)
    stream_text = None
    if args.stream and not args.json:
        if not args.chat:
            print(prompt, end="", flush=True)

        def stream_text(row: int, text: str) -> None:
            print(text, end="", flush=True)

    result = decoder.generate(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        stream_text=stream_text, images=args.image or None, **kwargs,
    )
    stats = result.stats.summary()
    if args.json:
        print(_json_line(result))
        return 0
    if not args.stream:
        print(result.text if args.chat else prompt + result.text)
    else:
        print()
    # without a verification step (a first token that ends the output) there is no tau or acceptance to show
    per_step = f"tau {stats['tau']:.2f}, acceptance {stats['acceptance_rate']:.2f}" if stats["steps"] else "tau n/a, acceptance n/a"
    print(
        f"[{args.method}] {stats['new_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, {per_step}, "
        f"{stats['steps']} steps, TTFT {stats['ttft_ms']:.0f} ms"
        + (f", {result.stats.relaxed_tokens} relaxed tokens, {result.stats.strict_fallbacks} strict fallbacks" if args.verify == "mars" else ""),
        file=sys.stderr,
    )
    return 0


def _add_serve(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) with batched speculative decoding",
        description="Serves the target (default: the bundled pair) with --method/--verify as defaults; requests may pick another "
        "method, rule or MARS theta in their `specdec` field. Design, API and metrics: docs/serving.md.",
    )
    add_model_args(srv)
    add_graphs_arg(srv)
    add_draft_rows_arg(srv)
    add_method_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1; 0.0.0.0 for every interface)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (8000)")
    srv.add_argument("--max-batch-size", type=int, default=8, help="rows decoded at once, over all lanes (8)")
    srv.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get HTTP 429 (64)")
    srv.add_argument("--model-name", default=None, help="the model id clients send and /v1/models lists (default: the target's name)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"), help="uvicorn's log level (info)")
    srv.set_defaults(func=_cmd_serve)


def _check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise SpecDecError(f"--port {args.port} is not a TCP port; give a number from 1 to 65535")
    if args.max_batch_size < 1:
        raise SpecDecError(f"--max-batch-size {args.max_batch_size} must be a positive integer")
    if args.max_queue < 0:
        raise SpecDecError(f"--max-queue {args.max_queue} must be 0 or more")


def check_port_free(host: str, port: int) -> None:
    """Bind (host, port) the way uvicorn will (SO_REUSEADDR) and let go, so a port in use is
    a one-line error before any model is loaded; port 0 (any free port) is always free."""
    import socket

    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise SpecDecError(f"--host {host!r} cannot be resolved ({err.strerror}); give an address such as 127.0.0.1 or 0.0.0.0") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise SpecDecError(f"--port {port} on {host} is not free ({err.strerror}); pick another --port or stop the process that listens there") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    require(None, "serve", "specdec serve")
    _check_server_args(args)
    check_graphs_arg(args)
    check_port_free(args.host, args.port)
    from specdec.serve import create_app, serve

    decoder = _decoder_for(args, args.target, args.draft)
    app = create_app(decoder, model_name=args.model_name, max_batch_size=args.max_batch_size, max_queue=args.max_queue)

    def listening(url: str) -> None:  # once it accepts connections, with the port it bound (--port 0: a free one)
        print(f"specdec: serving {app.state.model_name!r} ({args.method}) on {url}/v1", file=sys.stderr, flush=True)

    serve(app, host=args.host, port=args.port, log_level=args.log_level, on_listening=listening)
    return 0


def _add_bench_serve(sub) -> None:
    from specdec.bench.defaults import DEFAULT_CONCURRENCY
    from specdec.bench.defaults import SERVE_METHODS as DEFAULT_METHODS

    bench = sub.add_parser(
        "bench-serve",
        help="benchmark `specdec serve` per method under 1..N concurrent streaming clients: throughput, TTFT, TPOT, speedup over AR",
        description="For each --methods item, starts the server in-process on a free port and runs every --concurrency level "
        "against it; writes report.md, results.json and serve.png into --out.",
    )
    bench.add_argument("--prompts", default="stdlib-heldout", help="'stdlib-heldout' (the bundled set) or a JSONL(.gz) file with 'prompt' or 'turns' lines")
    add_model_args(bench)
    add_graphs_arg(bench)
    add_draft_rows_arg(bench)
    add_method_args(bench, multi=True, methods_default=DEFAULT_METHODS)
    bench.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help=f"comma-separated numbers of concurrent clients ({DEFAULT_CONCURRENCY})")
    bench.add_argument("--requests-per-client", type=int, default=4, help="requests each client sends, one after another (4)")
    bench.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (64)")
    bench.add_argument("--temperature", type=float, default=0.0, help="temperature of every request (0 = greedy)")
    bench.add_argument("--num-prompts", type=int, default=0, help="N prompts spread evenly over the set (0 = all)")
    bench.add_argument("--max-batch-size", type=int, default=None, help="the server's --max-batch-size (default: the largest --concurrency)")
    bench.add_argument("--out", required=True, help="output folder: report.md, results.json, serve.png")
    bench.set_defaults(func=_cmd_bench_serve)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    require(None, "serve", "specdec bench-serve")
    require(None, "bench", "specdec bench-serve")
    check_out_dir(args.out)
    from specdec.bench.serving import ServeBenchConfig, run_serve_bench
    from specdec.bench.variants import parse_method_specs
    from specdec.methods import POLICY_CLASSES

    specs = parse_method_specs(args.methods)
    engine_methods = list(dict.fromkeys(spec.method for spec in specs if spec.method in POLICY_CLASSES))
    if args.verify not in ("auto", "greedy", "sampling", "mars"):
        raise SpecDecError(f"--verify {args.verify!r}: bench-serve takes one accept rule (greedy, sampling, mars or auto); give others per item, e.g. chain@mars")
    if args.mars_theta is not None and args.verify != "mars" and not any(spec.rule == "mars" for spec in specs):
        raise SpecDecError(f"--mars-theta applies only to --verify mars or items METHOD@mars (got --verify {args.verify})")
    if args.num_prompts < 0:
        raise SpecDecError(f"--num-prompts {args.num_prompts} must be 0 (all) or more")
    check_graphs_arg(args)
    config = ServeBenchConfig(
        prompts=args.prompts,
        out=args.out,
        methods=[spec.text for spec in specs],
        concurrency=parse_int_list(args.concurrency, "--concurrency"),
        requests_per_client=args.requests_per_client,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        num_prompts=args.num_prompts or None,
        max_batch_size=args.max_batch_size,
        **pair_fields(args),
        method_options={m: collect_method_options(args, m, strict=False) for m in engine_methods},
        mars_theta=args.mars_theta,
        verify=args.verify,
        decoder_options={
            "draft_source": args.draft_source, "lookup_ngram": args.lookup_ngram, "views": args.views, "ensemble_options": ensemble_options(args),
            "cuda_graphs": args.cuda_graphs, "max_draft_rows": args.max_draft_rows,
        },
    )
    outputs = run_serve_bench(config, getattr(args, "argv", ()))
    print(f"report: {outputs.report}\nresults: {outputs.results}\nplot: {outputs.plot}")
    return 0


def _add_bench(sub) -> None:
    from specdec.bench.defaults import BENCH_METHODS as DEFAULT_METHODS
    from specdec.bench.defaults import PEERS, SCHEDULES

    bench = sub.add_parser("bench", help="benchmark methods and Hugging Face peers against plain AR, same prompts, same process")
    bench.add_argument(
        "--prompts", default=None,
        help="'stdlib-heldout' (the bundled set; the default) or a JSONL(.gz) file with 'prompt' or 'turns' lines; with --synthetic: the pair's random-token prompts",
    )
    add_model_args(bench)
    add_graphs_arg(bench)
    add_draft_rows_arg(bench)
    add_method_args(bench, multi=True, methods_default=DEFAULT_METHODS, extra_methods=PEERS)
    add_sampling_args(bench)
    bench.add_argument("--batch-size", type=int, default=1, help="prompts decoded together by the engine (hf runs them as one batched generate(); hf-assisted and hf-lookup only at 1)")
    bench.add_argument("--batch-sizes", default=None, help="run the whole bench at each of these batch sizes (e.g. 1,2,4,8,16) and compare them")
    bench.add_argument(
        "--schedule",
        default="groups",
        choices=SCHEDULES,
        help="how prompts meet the batch: groups (default) of --batch-size prompts, each group decoded to its last row's end before the next; "
        "rolling: every prompt through one rolling batch of --batch-size rows, a finished row's place going to the next prompt at the next step, "
        "as `specdec serve` batches (one timed call per repeat; HF's generate() cannot roll, so hf decodes the groups back to back in that call)",
    )
    bench.add_argument("--repeats", type=int, default=3, help="measured rounds over every prompt (figures are medians)")
    bench.add_argument("--num-prompts", type=int, default=10, help="N prompts spread evenly over the set (0 = all)")
    bench.add_argument("--out", required=True, help="output folder: report.md, results.json, PNG plots")
    bench.add_argument(
        "--quality",
        action="store_true",
        help="also measure output quality after the timed run: agreement with AR's output, the target's NLL of each completion "
        "(one extra target forward per distinct completion), the share of code completions that parse, the relaxed share",
    )
    bench.add_argument(
        "--mars-thetas",
        default=None,
        help="MARS θ sweep, e.g. 0.84,0.86,0.88,0.9,0.92,0.94,0.96: every engine method runs strictly and with --verify mars "
        "at each θ (labels method/greedy, method/mars[theta=0.84], ...); implies --quality and writes mars_sweep.png; "
        "run once with --temperature 0 and once with --temperature 1 --seed N",
    )
    bench.add_argument(
        "--code-prompts",
        default="auto",
        choices=("auto", "all", "none"),
        help="which prompts count as code for the parse share: auto (a 'language: python' line, an id ending in .py or starting with HumanEval), all, none",
    )
    bench.add_argument(
        "--chat", action="store_true",
        help="instruct models: every prompt (each turn a user message) goes through the tokenizer's chat template; "
        "without it only multi-turn prompts use the template (when there is one)",
    )
    bench.add_argument("--system", default=None, metavar="TEXT", help="a system message first in every conversation (implies --chat)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    w = bench.add_argument_group(
        "what-if study on synthetic pairs (docs/synthetic-pairs.md; random weights: for timing, never for text)"
    )
    w.add_argument(
        "--synthetic", metavar="SHAPE", default=None,
        help="build a synthetic target of this shape (a name from `specdec synth-pair --list`, or a config.json) and one draft per "
        "--agreements value, run the bench on each pair and compare: OUT/report.md, results.json, speedup_vs_agreement.png",
    )
    w.add_argument("--agreements", default=None, help="greedy agreements of the drafts, each in (0, 1] (default 0.5,0.7,0.8,0.9,0.95)")
    w.add_argument("--synth-cache", default=None, help="folder of the built pairs, reused by later runs (default ~/.cache/specdec/synthetic, or $SPECDEC_CACHE_DIR/synthetic)")
    w.add_argument("--draft-layers", default=None, help="layers of each draft, the target's first ones (default 1)")
    w.add_argument("--head-scale", default=None, help="factor on the target's head, or auto (default: auto, mean top-1 probability 0.75)")
    w.add_argument("--synth-seed", default=None, help="seed of the pair's weights, prompts and calibration (default 0)")
    w.add_argument("--prompt-tokens", default=None, help="length of the random-token prompts (default 64)")
    bench.set_defaults(func=_cmd_bench)


SYNTH_FLAGS = ("agreements", "synth_cache", "draft_layers", "head_scale", "synth_seed", "prompt_tokens")
"""`specdec bench` flags that only apply with --synthetic"""


def _int_option(text: str | None, flag: str, default: int, minimum: int = 1) -> int:
    """A command-line integer, or `default` when not given; a SpecDecError names a bad one."""
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise SpecDecError(f"{flag} {text!r} is not an integer; give e.g. {default}") from None
    if value < minimum:
        raise SpecDecError(f"{flag} {value} must be {'a positive integer' if minimum == 1 else f'at least {minimum}'}")
    return value


def _cmd_whatif(args: argparse.Namespace, config: BenchConfig) -> int:
    """`specdec bench --synthetic SHAPE`: the what-if study (specdec.bench.whatif)."""
    from specdec.bench.runner import BASELINE
    from specdec.bench.whatif import DEFAULT_AGREEMENTS, WhatIfConfig, default_cache, parse_agreements, run_whatif
    from specdec.models.synthetic import parse_head_scale

    for name in ("target", "draft", "batch_sizes"):
        if getattr(args, name) is not None:
            raise SpecDecError(f"--{name.replace('_', '-')} does not go with --synthetic, which builds its own pair and runs at --batch-size; drop it")
    if config.prompts == "stdlib-heldout":
        raise SpecDecError("--prompts stdlib-heldout is text the synthetic pair's tokenizer cannot read (it knows only t1 ... tN); leave --prompts out")
    whatif = WhatIfConfig(
        shape=args.synthetic,
        agreements=parse_agreements(args.agreements or DEFAULT_AGREEMENTS),
        cache=args.synth_cache or str(default_cache()),
        draft_layers=_int_option(args.draft_layers, "--draft-layers", 1),
        head_scale=parse_head_scale(args.head_scale or "auto"),
        seed=_int_option(args.synth_seed, "--synth-seed", 0, minimum=0),
        prompt_tokens=_int_option(args.prompt_tokens, "--prompt-tokens", 64),
    )
    outputs = run_whatif(config, whatif, getattr(args, "argv", ()), log=lambda line: print(line, file=sys.stderr, flush=True))
    for run in outputs.runs:
        best = max((s for s in run.summaries if s.label != BASELINE), key=lambda s: s.speedup, default=None)
        if best is not None:
            print(f"agreement {run.draft.agreement_requested:g} (achieved {run.draft.agreement_achieved:.3f}): fastest {best.label} {best.speedup:.2f}x AR")
    print(f"report: {outputs.report}\nresults: {outputs.results}\nplot: {outputs.plot}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    require(None, "bench", "specdec bench")
    check_out_dir(args.out)
    check_seed(args.seed)
    if args.synthetic is not None:  # the shape first: an empty or unknown one is the error to name
        from specdec.models.synthetic import load_shape

        load_shape(args.synthetic, flag="--synthetic")
    from specdec.bench import BenchConfig, run_and_report
    from specdec.bench.report import print_summary
    from specdec.bench.runner import parse_verify
    from specdec.bench.variants import parse_method_specs, parse_thetas
    from specdec.methods import POLICY_CLASSES, method_options

    specs = parse_method_specs(args.methods)
    methods = [spec.text for spec in specs]
    verify = parse_verify(args.verify, args.temperature)
    engine_methods = list(dict.fromkeys(spec.method for spec in specs if spec.method in POLICY_CLASSES))
    options = {m: collect_method_options(args, m, strict=False) for m in engine_methods}
    allowed = {f for m in engine_methods for f in method_options(m)}
    for flag in method_flags():
        if getattr(args, flag.dest, None) is not None and flag.field not in allowed:
            raise SpecDecError(f"{flag.flag} applies to none of --methods {','.join(methods)}; drop it or add a method that takes it")
    thetas = parse_thetas(args.mars_thetas) if args.mars_thetas is not None else None
    if thetas is not None and args.verify != "auto":
        raise SpecDecError(f"--mars-thetas runs every method strictly and with mars at each theta; drop --verify {args.verify}")
    if thetas is not None and args.mars_theta is not None:
        raise SpecDecError("give either --mars-theta (one theta) or --mars-thetas (a sweep), not both")
    if args.mars_theta is not None and "mars" not in verify and not any(spec.rule == "mars" for spec in specs):
        raise SpecDecError(f"--mars-theta applies only to --verify mars or items METHOD@mars (got --verify {args.verify})")
    if args.synthetic is None:
        given = [f"--{name.replace('_', '-')}" for name in SYNTH_FLAGS if getattr(args, name) is not None]
        if given:
            which = f"{given[0]} only applies" if len(given) == 1 else f"{', '.join(given)} only apply"
            raise SpecDecError(f"{which} with --synthetic SHAPE (a what-if study on synthetic pairs); add it or drop {'it' if len(given) == 1 else 'them'}")
    config = BenchConfig(
        prompts=args.prompts or ("" if args.synthetic else "stdlib-heldout"),
        out=args.out,
        methods=methods,
        verify=verify,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        batch_size=args.batch_size,
        schedule=args.schedule,
        repeats=args.repeats,
        num_prompts=None if args.num_prompts == 0 else args.num_prompts,
        seed=0 if args.seed is None else args.seed,
        **pair_fields(args),
        method_options=options,
        mars_theta=args.mars_theta,
        mars_thetas=thetas,
        quality=args.quality or thetas is not None,
        code_prompts=args.code_prompts,
        progress=not args.no_progress,
        draft_source=args.draft_source,
        lookup_ngram=args.lookup_ngram,
        cuda_graphs=args.cuda_graphs,
        max_draft_rows=args.max_draft_rows,
        chat=args.chat or args.system is not None,
        system=args.system,
    )
    check_graphs_arg(args)
    if args.synthetic is not None:
        return _cmd_whatif(args, config)
    if args.batch_sizes is not None:  # an empty list is an error (parse_int_list), not "no sweep"
        from specdec.bench.batch_sweep import run_batch_sweep
        sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
        print(f"batch sweep: {run_batch_sweep(config, sizes, getattr(args, 'argv', ()))}")
        return 0
    outputs = run_and_report(config, getattr(args, "argv", ()))
    print_summary(outputs.summaries)
    for note in outputs.result.notes:  # also in the report; here so that a skipped method or a short prompt file is not missed
        print(f"specdec: note: {note}", file=sys.stderr)
    print(f"report: {outputs.report}\nresults: {outputs.results}\nplots: {', '.join(str(p) for p in outputs.plots)}")
    return 0


def _add_sweep(sub) -> None:
    from specdec.bench.defaults import DEFAULT_BRANCHINGS, DEFAULT_DEPTHS, DEFAULT_TAUS, estimate_text

    full = estimate_text(90, 3, 2, 128).replace("%", "%%")
    sweep = sub.add_parser(
        "sweep",
        help="DynaTree grid: tree depth x branching x pruning threshold, greedy speedup over AR measured in the same run",
        description="Runs the dynatree policy (phase 0: fixed tree) at every (D, B, prune tau) of the grid and AR, interleaved, "
        "in one process; writes sweep.md, sweep.json and one heatmap per tau. Cost: every config generates up to "
        "prompts x repeats x max-new-tokens tokens; the full default grid on the bundled pair: " + full + ". "
        "Shrink --num-prompts, --repeats, --max-new-tokens or the lists for a quick look.",
    )
    sweep.add_argument("--prompts", default="stdlib-heldout", help="'stdlib-heldout' (the bundled set) or a JSONL(.gz) file with 'prompt' or 'turns' lines")
    add_model_args(sweep)
    sweep.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"tree depths D (dynatree d0) (default {DEFAULT_DEPTHS})")
    sweep.add_argument("--branchings", default=DEFAULT_BRANCHINGS, help=f"children per node B (dynatree b_mid) (default {DEFAULT_BRANCHINGS})")
    sweep.add_argument("--taus", default=DEFAULT_TAUS, help=f"pruning thresholds tau (dynatree prune_tau; 0 = off) (default {DEFAULT_TAUS})")
    sweep.add_argument("--phase", type=int, default=0, help="dynatree phase of every config: 0 fixed tree (default); 1-3 add the adaptive rules, D and B then set d0 and b_mid")
    sweep.add_argument("--max-nodes", type=int, default=256, help="node budget N_max, draft tokens per step (default 256, the paper's)")
    sweep.add_argument("--max-new-tokens", type=int, default=128)
    sweep.add_argument("--num-prompts", type=int, default=3, help="N prompts spread evenly over the set (0 = all; default 3)")
    sweep.add_argument("--repeats", type=int, default=2, help="measured rounds over every prompt (default 2)")
    sweep.add_argument("--seed", type=int, default=0, help="seeds the method-order shuffle")
    sweep.add_argument("--out", required=True, help="output folder: sweep.md, sweep.json, heatmap_tau_*.png")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    sweep.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    require(None, "bench", "specdec sweep")
    check_out_dir(args.out)
    check_seed(args.seed)
    from specdec.bench.prompts import load_prompts, resolve_prompt_source
    from specdec.bench.sweep import SweepConfig, best_row, check_phase, estimate_text, grid_points, parse_float_list, run_sweep

    check_phase(args.phase)  # before the plan (and its time estimate) is printed
    config = SweepConfig(
        prompts=args.prompts,
        out=args.out,
        depths=parse_int_list(args.depths, "--depths"),
        branchings=parse_int_list(args.branchings, "--branchings"),
        taus=parse_float_list(args.taus, "--taus"),
        phase=args.phase,
        max_nodes=args.max_nodes,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        num_prompts=None if args.num_prompts == 0 else args.num_prompts,
        seed=args.seed,
        **pair_fields(args),
        progress=not args.no_progress,
    )
    n_prompts = len(load_prompts(resolve_prompt_source(config.prompts), config.num_prompts))
    print(f"sweep: {estimate_text(len(grid_points(config)), n_prompts, config.repeats, config.max_new_tokens)}", file=sys.stderr)
    outputs = run_sweep(config, getattr(args, "argv", ()))
    best = best_row(outputs.rows)
    if best is not None:
        print(f"best: {best.point.label}: {best.summary.speedup:.2f}x AR ({best.summary.tokens_per_s_median:.1f} vs {outputs.ar.tokens_per_s_median:.1f} tok/s)")
    print(f"table: {outputs.markdown}\nresults: {outputs.json}\nheatmaps: {', '.join(str(p) for p in outputs.heatmaps)}")
    return 0


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train the project's own tokenizer and target/draft pair")
    tsub = train.add_subparsers(dest="what", required=True, parser_class=_Parser)
    tok = tsub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a code corpus")
    tok.add_argument("--corpus", nargs="*", default=[], help="folders or files (default: this Python's standard library)")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument("--out", required=True, help="output folder (AutoTokenizer.from_pretrained loads it)")
    tok.set_defaults(func=_cmd_train_tokenizer)

    pair = tsub.add_parser("pair", help="train tokenizer, GPT-NeoX target and distilled draft")
    pair.add_argument("--corpus", nargs="*", default=[], help="folders or files (default: this Python's standard library)")
    pair.add_argument("--out", required=True, help="output folder: tokenizer/, target/, draft/, prompts, logs")
    pair.add_argument("--tokenizer", default=None, help="use this trained tokenizer folder instead of training one")
    pair.add_argument("--vocab-size", type=int, default=8192)
    pair.add_argument("--seed", type=int, default=0)
    pair.add_argument("--target-steps", type=int, default=1000)
    pair.add_argument("--draft-steps", type=int, default=500)
    pair.add_argument("--seq-len", type=int, default=512)
    pair.add_argument("--distill-weight", type=float, default=0.5, help="weight of KL(target||draft) in the draft loss; 0 disables distillation")
    pair.add_argument("--target-from", default=None, help="reuse this trained target folder (train only a draft)")
    pair.add_argument("--with-packages", action="store_true",
                      help="also train on the licence-filtered, deduplicated .py sources of installed packages (held-out figures stay standard-library only)")
    pair.add_argument("--site-packages", default=None, help="the site-packages folder for --with-packages (default: this interpreter's)")
    pair.add_argument("--init-target", default=None, help="warm start: initialise the target from this trained model folder (fresh optimizer and LR schedule)")
    pair.add_argument("--init-draft", default=None, help="warm start: initialise the draft from this trained model folder")
    pair.add_argument(
        "--unlikelihood-steps", type=int, default=0,
        help="after the target stage, fine-tune the target this many steps with sequence-level unlikelihood on its own "
        "greedy continuations (against loops; docs/bundled-pair.md); 0: none",
    )
    pair.add_argument("--draft-lr", type=float, default=2e-3, help="peak learning rate of the draft (2e-3; lower for a warm start)")
    pair.add_argument("--unlikelihood-lr", type=float, default=1e-4, help="peak LR of the unlikelihood fine-tuning (1e-4)")
    pair.add_argument("--unlikelihood-weight", type=float, default=1.0, help="weight of the unlikelihood term beside the next-token loss (1.0)")
    pair.add_argument(
        "--draft-layers", type=int, default=None,
        help="decoder layers of the draft (default 1); with --init-draft of fewer layers, the new ones start as the identity (`deepen`)",
    )
    pair.add_argument("--target-lr", type=float, default=1e-3, help="peak learning rate of the target (1e-3)")
    pair.add_argument("--target-batch-size", type=int, default=None, help="target sequences per step (default 4; 2 with --tiny)")
    pair.add_argument("--target-warmup", type=int, default=50, help="linear warm-up steps of the target (50)")
    pair.add_argument("--target-decay-steps", type=int, default=None,
                      help="hold the peak LR after warm-up and decay (cosine) only over the last N of --target-steps; "
                           "lets a run be extended by raising --target-steps (default: cosine over all steps)")
    pair.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints of each stage (100)")
    pair.add_argument("--eval-every", type=int, default=50, help="steps between held-out losses on the fixed held-out sample (50)")
    pair.add_argument("--heldout-windows", type=int, default=16, help="windows of --seq-len tokens in that sample (16; 0 disables it)")
    pair.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    pair.add_argument("--tiny", action="store_true", help="tiny shapes and batches (for tests and smoke runs)")
    pair.set_defaults(func=_cmd_train_pair)

    bundle = tsub.add_parser("bundle", help="copy a trained pair into the package (the default --target/--draft)")
    bundle.add_argument("--from", dest="source", required=True, help="the --out folder of `specdec train pair`")
    bundle.set_defaults(func=_cmd_train_bundle)

    lvlm = tsub.add_parser("lvlm", help="train the tiny LLaVA-style target/draft pair on synthetic scenes")
    lvlm.add_argument("--out", required=True, help="output folder: tokenizer/, target/, draft/, train_log.json")
    lvlm.add_argument("--minutes", type=float, default=45.0, help="wall-time budget; the step count is set from the speed of the first steps")
    lvlm.add_argument("--steps", type=int, default=None, help="a fixed number of optimizer steps instead of --minutes")
    lvlm.add_argument("--batch-size", type=int, default=16)
    lvlm.add_argument("--seed", type=int, default=0)
    lvlm.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    lvlm.add_argument("--vision-lr-scale", type=float, default=0.0, help="vision tower + projector learning rate / the language model's (0: frozen at random init, the default)")
    lvlm.add_argument("--tiny", action="store_true", help="tiny shapes (for tests and smoke runs)")
    lvlm.add_argument("--bundle", action="store_true", help="copy the result into the package (the default LVLM pair)")
    lvlm.set_defaults(func=_cmd_train_lvlm)

    evl = tsub.add_parser("evaluate-lvlm", help="LVLM model-card figures: exact match per scene task with and without the image, latency")
    add_model_args(evl)
    evl.add_argument("--per-task", type=int, default=40, help="evaluation examples per task")
    evl.add_argument("--out", default=None, help="also write the figures to this JSON file")
    evl.set_defaults(func=_cmd_train_evaluate_lvlm)

    ev = tsub.add_parser("evaluate", help="model-card figures: held-out perplexity, top-1 agreement, latency")
    add_model_args(ev)
    ev.add_argument("--corpus", nargs="*", default=[], help="the corpus the pair was trained on (default: the standard library)")
    ev.add_argument("--max-tokens", type=int, default=65536, help="held-out tokens to score")
    ev.add_argument("--no-latency", action="store_true", help="skip the latency figures (quality only; cheap on a busy machine)")
    ev.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ev.add_argument("--loops", action="store_true", help="also the share of the target's greedy completions of --prompts that end in a short loop")
    ev.add_argument("--prompts", default="stdlib-heldout", help="prompt set for --loops (default: the bundled stdlib-heldout set)")
    ev.add_argument("--loop-tokens", type=int, default=128, help="new tokens per --loops completion (128, as `specdec bench`)")
    ev.add_argument("--out", default=None, help="also write the figures to this JSON file")
    ev.set_defaults(func=_cmd_train_evaluate)


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from specdec.training.corpus import iter_texts, training_split
    from specdec.training.tokenizer import MIN_VOCAB, train_tokenizer

    check_out_dir(args.out)
    if args.vocab_size < MIN_VOCAB:
        raise SpecDecError(f"--vocab-size={args.vocab_size} is too small for byte-level BPE (256 bytes + specials); use {MIN_VOCAB} or more")
    train_files, _ = training_split([Path(c) for c in args.corpus] or None, heldout_needed=False)
    train_tokenizer(iter_texts(train_files), Path(args.out), vocab_size=args.vocab_size)
    print(f"tokenizer saved to {args.out}")
    return 0


def _check_trained_folder(flag: str, folder: str, needs: str) -> None:
    """A folder of a finished training run (`needs`: the file it must hold), checked before any training."""
    path = Path(folder).expanduser()
    kind, example = ("tokenizer folder", "runs/pair/tokenizer") if needs == "tokenizer.json" else ("model folder", "specdec/assets/pair/target")
    if not folder.strip():
        raise SpecDecError(f"{flag} is empty; pass a trained {kind} such as {example}, or leave {flag} out")
    why = "it does not exist" if not path.exists() else "it is a file" if not path.is_dir() else None if (path / needs).is_file() else f"no {needs}"
    if why is not None:
        raise SpecDecError(f"{flag} {folder!r} is not a {kind} ({why}); pass a trained {kind} such as {example}")


def _cmd_train_pair(args: argparse.Namespace) -> int:
    from specdec.training.pair import ModelShape, PairConfig, StageConfig, train_pair

    check_out_dir(args.out)
    check_seed(args.seed)
    for flag, folder, needs in (
        ("--tokenizer", args.tokenizer, "tokenizer.json"), ("--target-from", args.target_from, "config.json"),
        ("--init-target", args.init_target, "config.json"), ("--init-draft", args.init_draft, "config.json"),
    ):
        if folder is not None:
            _check_trained_folder(flag, folder, needs)
    for name in ("target_lr", "draft_lr", "unlikelihood_lr", "distill_weight", "unlikelihood_weight"):
        if not math.isfinite(getattr(args, name)):
            raise SpecDecError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a finite number")
    if args.tokenizer is None and args.init_target is None:  # a tokenizer is trained: its size first, before anything is written
        from specdec.training.tokenizer import MIN_VOCAB

        if args.vocab_size < MIN_VOCAB:
            raise SpecDecError(f"--vocab-size={args.vocab_size} is too small for byte-level BPE (256 bytes + specials); use {MIN_VOCAB} or more")
    for name in ("target_steps", "draft_steps", "seq_len", "checkpoint_every", "eval_every"):
        if getattr(args, name) <= 0:
            raise SpecDecError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    for name in ("target_batch_size", "target_decay_steps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise SpecDecError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    for name in ("target_warmup", "heldout_windows", "threads"):
        if getattr(args, name) < 0:
            raise SpecDecError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    if not args.target_lr > 0:
        raise SpecDecError(f"--target-lr={args.target_lr} must be positive")
    if not 0 <= args.distill_weight <= 1:
        raise SpecDecError(f"--distill-weight={args.distill_weight} must be in [0, 1]")
    if args.target_from and args.init_target:
        raise SpecDecError("--target-from (reuse a target unchanged) and --init-target (train a warm-started target) exclude each other; pass one")
    if args.site_packages and not args.with_packages:
        raise SpecDecError(f"--site-packages {args.site_packages} needs --with-packages")
    if args.threads:
        import os

        import torch

        torch.set_num_threads(args.threads)
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # the tokenizers library's thread pool
    tokenizer_dir = args.tokenizer or args.init_target  # a warm start keeps its model's tokenizer
    batch_t, batch_d = (2, 2) if args.tiny else (4, 8)
    cfg = PairConfig(
        out_dir=args.out,
        corpus=list(args.corpus),
        vocab_size=args.vocab_size,
        seed=args.seed,
        target_from=args.target_from,
        init_target=args.init_target,
        init_draft=args.init_draft,
        packages=args.with_packages,
        site_packages=args.site_packages,
        heldout_sample_windows=args.heldout_windows,
        target=StageConfig(
            steps=args.target_steps, batch_size=args.target_batch_size or batch_t, seq_len=args.seq_len, lr=args.target_lr,
            warmup_steps=min(args.target_warmup, args.target_steps), decay_steps=args.target_decay_steps,
            checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        ),
        draft=StageConfig(
            steps=args.draft_steps, batch_size=batch_d, seq_len=args.seq_len, lr=args.draft_lr, warmup_steps=min(50, args.draft_steps), distill_weight=args.distill_weight,
            checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        ),
    )
    if args.tiny:
        cfg.target_shape = ModelShape(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
        cfg.draft_shape = ModelShape(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64)
    if args.draft_lr <= 0:
        raise SpecDecError(f"--draft-lr {args.draft_lr} must be > 0")
    if args.unlikelihood_steps < 0 or args.unlikelihood_lr <= 0 or args.unlikelihood_weight < 0:
        raise SpecDecError(
            f"--unlikelihood-steps {args.unlikelihood_steps}, --unlikelihood-lr {args.unlikelihood_lr}, --unlikelihood-weight "
            f"{args.unlikelihood_weight}: steps and weight must be >= 0 and the LR > 0"
        )
    if args.unlikelihood_steps:
        from specdec.training.unlikelihood import UnlikelihoodConfig

        cfg.unlikelihood = StageConfig(
            steps=args.unlikelihood_steps, batch_size=args.target_batch_size or batch_t, seq_len=args.seq_len, lr=args.unlikelihood_lr,
            warmup_steps=min(10, args.unlikelihood_steps), checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        )
        cfg.unlikelihood_loss = UnlikelihoodConfig(weight=args.unlikelihood_weight, **({"prefix_len": 8, "continuation_len": 12, "batch_size": 2} if args.tiny else {}))
    if args.draft_layers is not None:
        if args.draft_layers < 1:
            raise SpecDecError(f"--draft-layers {args.draft_layers}: a draft needs at least 1 layer")
        import dataclasses

        cfg.draft_layers = args.draft_layers
        cfg.draft_shape = dataclasses.replace(cfg.draft_shape, num_layers=args.draft_layers)
    summary = train_pair(cfg, tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir else None)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_train_lvlm(args: argparse.Namespace) -> int:
    import dataclasses

    require(None, "vision", "specdec train lvlm")
    check_out_dir(args.out)

    from specdec.training.lvlm import DRAFT_SIZE, TARGET_SIZE
    from specdec.training.lvlm_train import LvlmTrainConfig, bundle_lvlm, train_lvlm

    if args.steps is not None and args.steps <= 0:
        raise SpecDecError(f"--steps={args.steps} must be a positive integer")
    if not 0 < args.minutes < math.inf:
        raise SpecDecError(f"--minutes={args.minutes} must be a positive number of minutes")
    if args.batch_size <= 0:
        raise SpecDecError(f"--batch-size={args.batch_size} must be a positive integer")
    if not 0 <= args.vision_lr_scale < math.inf:
        raise SpecDecError(f"--vision-lr-scale={args.vision_lr_scale} must be a number >= 0")
    if args.threads < 0:
        raise SpecDecError(f"--threads={args.threads} must be >= 0 (0: torch's default)")
    check_seed(args.seed)
    cfg = LvlmTrainConfig(
        steps=args.steps, minutes=args.minutes, batch_size=args.batch_size, seed=args.seed, threads=args.threads, vision_lr_scale=args.vision_lr_scale
    )
    target_size, draft_size = TARGET_SIZE, DRAFT_SIZE
    if args.tiny:
        target_size = dataclasses.replace(TARGET_SIZE, vision_hidden=32, vision_layers=1, vision_heads=2, text_hidden=32, text_layers=1, text_heads=2, image_size=96, patch_size=32)
        draft_size = dataclasses.replace(target_size, text_hidden=16, text_heads=1)
        cfg.vocab_size, cfg.warmup_steps = 400, 2
    out = Path(args.out)
    train_lvlm(out, cfg, target_size, draft_size, log=lambda line: print(line, flush=True))
    if args.bundle:
        print(f"bundled LVLM pair copied to {bundle_lvlm(out)}")
    return 0


def _check_lvlm_pair_args(args: argparse.Namespace, command: str) -> None:
    """--target without --draft: the commands that compare an LVLM pair need both (without
    --target they use the bundled LVLM pair)."""
    if args.target is not None and args.draft is None:
        raise SpecDecError(
            f"specdec {command} --target {args.target} needs --draft too (a vision-language draft sharing its tokenizer); "
            "pass --draft PATH, or leave both out for the bundled LVLM pair"
        )


def _cmd_train_evaluate_lvlm(args: argparse.Namespace) -> int:
    require(None, "vision", "specdec train evaluate-lvlm")
    from specdec.api import SpeculativeDecoder
    from specdec.training.lvlm_eval import evaluate_lvlm

    if args.per_task < 1:
        raise SpecDecError(f"--per-task={args.per_task} must be a positive integer")
    if args.out is not None:
        check_out_file(args.out, example="figures.json")
    _check_lvlm_pair_args(args, "train evaluate-lvlm")
    target, draft = args.target or bundled_lvlm_target(), args.draft or (None if args.target else bundled_lvlm_draft())
    decoder = SpeculativeDecoder.from_pretrained(target, draft, method="chain", device=args.device, dtype=args.dtype, **load_kwargs(args))
    if not decoder.multimodal or decoder.draft is None:
        raise SpecDecError("evaluate-lvlm needs a vision-language target and draft")
    figures = evaluate_lvlm(decoder.target, decoder.draft, decoder.processor, per_task=args.per_task)
    text = json.dumps(figures, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _cmd_train_bundle(args: argparse.Namespace) -> int:
    from specdec.training.pair import bundle_pair

    source = Path(args.source).expanduser()
    if not args.source.strip() or not source.is_dir():
        why = "is empty" if not args.source.strip() else "does not exist" if not source.exists() else "is a file"
        raise SpecDecError(f"--from {args.source!r} {why}; pass the --out folder of a finished `specdec train pair` run")
    dest = bundle_pair(source)
    print(f"bundled pair copied to {dest}")
    return 0


def _cmd_train_evaluate(args: argparse.Namespace) -> int:
    from specdec.api import SpeculativeDecoder
    from specdec.training.evaluate import evaluate_pair, heldout_texts

    if args.out is not None:
        check_out_file(args.out, example="figures.json")
    if args.max_tokens <= 0 or args.loop_tokens <= 0:
        raise SpecDecError(f"--max-tokens={args.max_tokens} and --loop-tokens={args.loop_tokens} must be positive integers")
    if args.threads < 0:
        raise SpecDecError(f"--threads={args.threads} must be >= 0")
    if args.prompts != "stdlib-heldout" and not args.loops:
        raise SpecDecError(f"--prompts {args.prompts} applies only with --loops (the loop share of greedy completions of those prompts); add --loops or drop --prompts")
    loop_prompts = None
    if args.loops:
        from specdec.bench.prompts import load_prompts, resolve_prompt_source

        # a missing or malformed file fails before the models load and the figures run
        items = load_prompts(resolve_prompt_source(args.prompts))
        with_images = sum(1 for p in items if p.images)
        if with_images:
            raise SpecDecError(
                f"--prompts {args.prompts!r}: {with_images} of its {len(items)} prompts have images, which the text pair cannot see; "
                "give text prompts, e.g. --prompts stdlib-heldout"
            )
        loop_prompts = [p.turns[0] for p in items]
    if args.target is not None and args.draft is None:
        raise SpecDecError(
            f"specdec train evaluate --target {args.target} needs --draft too (the figures compare the two models); "
            "pass --draft PATH, e.g. --draft specdec/assets/pair/draft for a target trained from the bundled pair"
        )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    corpus = [Path(c) for c in args.corpus] or None
    texts = heldout_texts(corpus)  # a corpus with nothing to score fails before loading
    decoder = SpeculativeDecoder.from_pretrained(args.target, args.draft, method="chain", device=args.device, dtype=args.dtype, **load_kwargs(args))
    if loop_prompts is not None:  # before the figures: every completion must fit the target's context
        from specdec.models.loading import context_length

        limit = context_length(decoder.target)
        longest = max(len(decoder.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in loop_prompts)
        if limit is not None and longest + args.loop_tokens > limit:
            raise SpecDecError(
                f"--loop-tokens {args.loop_tokens}: the longest --prompts prompt ({longest} tokens) and {args.loop_tokens} new tokens "
                f"exceed the target's context of {limit} tokens; use --loop-tokens {max(1, limit - longest)} or less"
            )
    figures = evaluate_pair(decoder.target, decoder.draft, decoder.tokenizer, corpus, args.max_tokens, latency=not args.no_latency, texts=texts)
    if loop_prompts is not None:
        from specdec.training.evaluate import greedy_loop_share

        figures.update(greedy_loop_share(decoder.target, decoder.tokenizer, loop_prompts, args.loop_tokens))
    text = json.dumps(figures, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _add_profile(sub) -> None:
    prof = sub.add_parser("profile", help="measure target/draft forward latencies f(B, c, n) for --method cast")
    add_model_args(prof)
    add_graphs_arg(prof)
    prof.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated batch sizes B (default 1,2,4,8,16)")
    prof.add_argument("--context-step", type=int, default=256, help="L: contexts are L, 2L, ..., M*L tokens (256)")
    prof.add_argument("--contexts", type=int, default=4, help="M: number of context buckets (4)")
    prof.add_argument("--n-grid", default="1,2,4,8,16,32,64,128", help="new-token counts n measured; others are interpolated (default 1,2,4,...,128)")
    prof.add_argument("--warmup", type=int, default=1, help="untimed forwards before each point (1)")
    prof.add_argument("--repeats", type=int, default=1, help="timed forwards per point and round at least, more while they add up to under 100 ms/3; the median is kept (1)")
    prof.add_argument(
        "--passes", type=int, default=3,
        help="rounds over the whole grid; a point's cost is the median of its rounds' medians, so a slow spell of a shared machine lands in one round, not in all of a point's timings (3)",
    )
    prof.add_argument("--out", required=True, help="output JSON file (the bundled pair's: specdec/assets/pair/cost_profile.json)")
    prof.set_defaults(func=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    check_out_file(args.out)
    from specdec.cost.profile import ProfileGrid, describe, profile_models
    from specdec.models.loading import bundled_draft, bundled_target, context_length, load_model, pair_load_options

    for flag, value, least in (("--context-step", args.context_step, 1), ("--contexts", args.contexts, 1), ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1), ("--passes", args.passes, 1)):
        if value < least:
            raise SpecDecError(f"{flag}={value} must be {'a positive integer' if least else 'an integer >= 0'}")
    grid = ProfileGrid(
        batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
        context_step=args.context_step,
        num_contexts=args.contexts,
        n_grid=sorted(parse_int_list(args.n_grid, "--n-grid")),  # points, in any order
        warmup=args.warmup,
        repeats=args.repeats,
        min_time_ms=100.0 / args.passes,
        max_repeats=max(1, 25 // args.passes),
        passes=args.passes,
    )
    target_name = args.target or bundled_target()
    draft_name = args.draft or (bundled_draft() if args.target is None else None)
    if draft_name is None:
        raise SpecDecError("--draft is required with --target: a cost profile covers both models of the pair")
    check_graphs_arg(args)
    target_load, draft_load = pair_load_options(**load_kwargs(args))
    target = load_model(target_name, "target", args.device, args.dtype, target_load)
    draft = load_model(draft_name, "draft", args.device, args.dtype, draft_load)
    from specdec.models.graphs import resolve_cuda_graphs

    graphs = resolve_cuda_graphs(args.cuda_graphs, next(target.parameters()).device)
    longest = grid.context_step * grid.num_contexts + grid.n_grid[-1]  # positions of the longest measured forward
    limits = [c for c in (context_length(target), context_length(draft)) if c]
    if limits and longest > min(limits):
        step = (min(limits) - grid.n_grid[-1]) // grid.num_contexts
        raise SpecDecError(
            f"--context-step {grid.context_step} x --contexts {grid.num_contexts} + {grid.n_grid[-1]} new tokens = {longest} positions, "
            f"beyond the models' context of {min(limits)}; use --context-step {step} or less (or fewer --contexts, a smaller --n-grid)"
        )
    print(f"profiling {grid.points()} points per model, {grid.passes} round(s) (batch sizes {list(grid.batch_sizes)}, contexts up to {grid.context_step * grid.num_contexts})", file=sys.stderr)
    try:
        table = profile_models(target, draft, grid, progress=lambda line: print(line, file=sys.stderr), cuda_graphs=graphs)
    except (MemoryError, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError; so is the CPU allocator's refusal
        if not isinstance(err, MemoryError) and "out of memory" not in str(err) and "can't allocate memory" not in str(err):
            raise
        raise SpecDecError(
            f"profiling ran out of memory on {next(target.parameters()).device} (the grid's largest forward: batch size {grid.batch_sizes[-1]}, "
            f"{longest} positions); use smaller --batch-sizes (or --context-step, --contexts, --n-grid)"
        ) from None
    path = table.save(args.out)
    print(describe(table))
    print(f"cost profile: {path} ({table.meta['seconds']} s)")
    return 0


def _add_scenes(sub) -> None:
    sc = sub.add_parser("scenes", help="write a synthetic multimodal prompt set (JSONL + PNG images) to a folder")
    sc.add_argument("--scenario", default="scenes-first-turn", help="scenes-first-turn (default), scenes-second-turn or scenes-ood")
    sc.add_argument("--num", type=int, default=24, help="prompts to write (24)")
    sc.add_argument("--seed", type=int, default=1234)
    sc.add_argument("--out", required=True, help="output folder: <scenario>.jsonl and images/")
    sc.set_defaults(func=_cmd_scenes)


def _cmd_scenes(args: argparse.Namespace) -> int:
    require(None, "vision", "specdec scenes")
    check_out_dir(args.out)
    from specdec.multimodal.scenes import check_scenario, export_scenario

    if args.num < 1:
        raise SpecDecError(f"--num={args.num} must be a positive integer")
    scenario = check_scenario(args.scenario)
    images, jsonl = Path(args.out) / "images", Path(args.out) / f"{scenario}.jsonl"
    if images.exists() and not images.is_dir():
        raise SpecDecError(f"--out {args.out!r} holds a file named images, where the images folder goes; move it or give another --out")
    if jsonl.is_dir():
        raise SpecDecError(f"--out {args.out!r} holds a folder named {jsonl.name}, where the prompt file goes; move it or give another --out")
    path = export_scenario(scenario, Path(args.out), n=args.num, seed=args.seed)
    print(f"wrote {args.num} prompts to {path} (images in {Path(args.out) / 'images'}); use it with specdec bench --prompts {path}")
    return 0


def _add_bench_tabed(sub) -> None:
    b = sub.add_parser("bench-tabed", help="TABED: block efficiency of drafting views and ensembles per multimodal scenario")
    add_model_args(b)
    b.add_argument("--scenarios", default="scenes-first-turn,scenes-second-turn,scenes-ood", help="comma-separated scenario prompt sets")
    b.add_argument("--gammas", default="3,5,7", help="chain lengths (draft tokens per step)")
    b.add_argument("--widths", default="2,3", help="tree widths d (trees: depth 5, top-d expansion, 5d nodes)")
    b.add_argument("--num-prompts", type=int, default=24)
    b.add_argument("--max-new-tokens", type=int, default=48)
    b.add_argument("--no-ablations", action="store_true", help="skip the window/distance ablations")
    b.add_argument("--out", required=True, help="output folder: report.md, results.json, plots")
    b.set_defaults(func=_cmd_bench_tabed)


def _cmd_bench_tabed(args: argparse.Namespace) -> int:
    import shlex

    require(None, "bench", "specdec bench-tabed")
    require(None, "vision", "specdec bench-tabed")
    check_out_dir(args.out)

    from specdec.api import SpeculativeDecoder
    from specdec.bench.tabed import check_tabed_shapes, run_tabed_bench
    from specdec.multimodal.scenes import check_scenario

    scenarios = [check_scenario(s.strip()) for s in args.scenarios.split(",") if s.strip()]
    if not scenarios:
        raise SpecDecError(f"--scenarios {args.scenarios!r} names no scenario; give e.g. scenes-first-turn,scenes-ood")
    gammas = parse_int_list(args.gammas, "--gammas")
    widths = parse_int_list(args.widths, "--widths")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise SpecDecError("--num-prompts and --max-new-tokens must be positive integers")
    check_tabed_shapes(gammas, widths)
    _check_lvlm_pair_args(args, "bench-tabed")
    target, draft = args.target or bundled_lvlm_target(), args.draft or (None if args.target else bundled_lvlm_draft())
    decoder = SpeculativeDecoder.from_pretrained(target, draft, method="chain", device=args.device, dtype=args.dtype, **load_kwargs(args))
    command = "specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    run_tabed_bench(
        decoder, Path(args.out), scenarios, gammas, widths, args.num_prompts, args.max_new_tokens, ablations=not args.no_ablations, command=command,
        log=lambda line: print(line, flush=True),
    )
    print(f"report written to {Path(args.out) / 'report.md'}")
    return 0


SYNTH_PAIR_DESCRIPTION = """\
Build a synthetic target/draft pair of a real model's shape, for TIMING AND WHAT-IF STUDIES ONLY:
the weights are random and the text is meaningless. The target has the shape's architecture and
size (a full forward's cost) but zeroed output projections in every layer after the first, so it
computes its first layer's function; the draft is that first layer (plus --draft-layers - 1 zeroed
ones) with the same embeddings, final norm and a noisy head, the noise calibrated so that the
draft's greedy choice equals the target's on --agreement of the decode positions. OUT holds
target/, draft/ (each loadable by --target/--draft of every command), prompts.jsonl (random-token
prompts) and synth_pair.json (shape, agreement requested and achieved, seed). Details:
docs/synthetic-pairs.md."""


def _add_synth_pair(sub) -> None:
    sp = sub.add_parser(
        "synth-pair",
        help="build a synthetic target/draft pair of a real model's shape with a chosen greedy agreement (timing and what-if studies only, not text)",
        description=SYNTH_PAIR_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sp.add_argument("--shape", default=None, help="a named shape (see --list: llama-3-8b, llama-3.2-1b, qwen2.5-7b, mistral-7b, tiny-llama, ...) or a config.json path")
    sp.add_argument("--list", action="store_true", help="list the named shapes and exit")
    sp.add_argument("--agreement", default="0.8", help="greedy agreement of the draft with the target, in (0, 1] (0.8)")
    sp.add_argument("--draft-layers", default="1", help="draft layers, the target's first ones; only the first computes, the rest add cost (1)")
    sp.add_argument("--dtype", default="bfloat16", help="saved dtype: float32, float16 or bfloat16 (bfloat16, the released checkpoints')")
    sp.add_argument("--seed", default="0", help="seed of every weight, the prompts and the calibration contexts (0)")
    sp.add_argument("--head-scale", default="auto", help="factor on the target's head (peaked distributions), or auto: mean top-1 probability 0.75 (auto)")
    sp.add_argument("--prompt-tokens", default="64", help="length of the random-token prompts used to calibrate and written to prompts.jsonl (64)")
    sp.add_argument("--device", default="auto", help="where the calibration runs: cpu, cuda or auto (weights are built on the CPU)")
    sp.add_argument("--out", default=None, help="output folder (new or empty): target/, draft/, prompts.jsonl, synth_pair.json")
    sp.set_defaults(func=_cmd_synth_pair)


def _float_option(text: str, flag: str, example: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SpecDecError(f"{flag} {text!r} is not a number; give e.g. {example}") from None


def _cmd_synth_pair(args: argparse.Namespace) -> int:
    from specdec.models.synthetic import DraftSpec, TargetSpec, load_shape, parse_head_scale, shape_names, synth_pair

    if args.list:
        for name in shape_names():
            shape = load_shape(name)
            c = shape.config
            print(
                f"{name:14s} {c.get('model_type')}: hidden {c.get('hidden_size')}, {c.get('num_hidden_layers')} layers, "
                f"{c.get('num_attention_heads')}/{c.get('num_key_value_heads', c.get('num_attention_heads'))} heads, "
                f"intermediate {c.get('intermediate_size')}, vocab {c.get('vocab_size')}  [{shape.source or 'no source model'}]"
            )
        return 0
    if args.shape is None:
        raise SpecDecError("--shape is required: a named shape (see --list) or a config.json path")
    if args.out is None:
        raise SpecDecError("--out is required: a new folder for target/, draft/, prompts.jsonl and synth_pair.json")
    spec = TargetSpec(
        shape=args.shape,
        dtype=args.dtype,
        seed=_int_option(args.seed, "--seed", 0, minimum=0),
        head_scale=parse_head_scale(args.head_scale),
        prompt_tokens=_int_option(args.prompt_tokens, "--prompt-tokens", 64),
    )
    draft = DraftSpec(agreement=_float_option(args.agreement, "--agreement", "0.8"), draft_layers=_int_option(args.draft_layers, "--draft-layers", 1))
    record = synth_pair(spec, draft, Path(args.out), device=args.device, log=lambda line: print(line, file=sys.stderr, flush=True))
    t, d = record.target, record.drafts["draft"]
    out = Path(args.out)
    print(
        f"{t.shape}: target {t.params / 1e6:,.1f}M parameters ({t.dims.get('num_hidden_layers')} layers, {t.dtype}), "
        f"draft {d.params / 1e6:,.1f}M ({d.draft_layers} layer(s)); head scale {t.head_scale:.3g}, target mean top-1 probability {t.target_top1:.2f}"
    )
    print(
        f"greedy agreement: requested {d.agreement_requested:g}, achieved {d.agreement_achieved:.3f} on {d.check_positions} held-out "
        f"decode positions ({d.measured_with}); noise std {d.noise_std:.4g}"
    )
    print(f"saved: {out / 'target'}, {out / 'draft'}, {out / 'prompts.jsonl'}, {out / 'synth_pair.json'}")
    print(f"try: specdec bench --target {out / 'target'} --draft {out / 'draft'} --prompts {out / 'prompts.jsonl'} --out runs/synth  (timing only: the text is meaningless)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_bench_serve(sub)
    _add_sweep(sub)
    _add_train(sub)
    _add_profile(sub)
    _add_bench_tabed(sub)
    _add_scenes(sub)
    _add_synth_pair(sub)
    return parser


def quiet_transformers() -> None:
    """transformers' warnings and weight-loading bars off (specdec reports what matters itself);
    the hub's download bars on, unless HF_HUB_DISABLE_PROGRESS_BARS says otherwise."""
    from huggingface_hub import constants
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # also turns the hub's bars off: they come back just below
    hf_logging.set_verbosity_error()
    if not constants.HF_HUB_DISABLE_PROGRESS_BARS:
        enable_progress_bars()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        quiet_transformers()
        if hasattr(args, "draft_source"):
            apply_draft_source_flags(args)
        if hasattr(args, "top_k") and hasattr(args, "temperature"):
            note_greedy_filters(args)
        return func(args)
    except (SpecDecError, FileNotFoundError) as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
