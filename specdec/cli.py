"""The `specdec` command: generate, bench, train."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from specdec.errors import SpecDecError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse's own errors already exit with status 2 and no traceback; kept as a hook."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target/--draft/--device/--dtype (the bundled pair by default)."""
    p.add_argument("--target", default=None, help="target model: local folder or hub id (default: the bundled pair's target)")
    p.add_argument("--draft", default=None, help="draft model sharing the target's tokenizer (default: the bundled pair's draft)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto (float32 on CPU)")


def add_method_args(p: argparse.ArgumentParser, multi: bool = False) -> None:
    """--method/--verify and every method option (each applies to the methods that take it)."""
    from specdec.methods import POLICY_CLASSES

    names = ", ".join(POLICY_CLASSES)
    if multi:
        p.add_argument("--methods", default="ar,chain,static,eagle2", help=f"comma-separated methods ({names})")
        p.add_argument("--verify", default="auto", help="comma-separated accept rules: greedy, sampling or auto (by temperature)")
    else:
        p.add_argument("--method", default="chain", help=f"one of {names} (default chain)")
        p.add_argument("--verify", default="auto", help="greedy, sampling, or auto: greedy at temperature 0, sampling above")
    g = p.add_argument_group("method options (defaults: each method's own)")
    g.add_argument("--k", type=int, default=None, help="chain: draft tokens per step (5)")
    g.add_argument("--depth", type=int, default=None, help="static/eagle2: tree depth (4 / 6)")
    g.add_argument("--branching", type=int, default=None, help="static: children per node (2)")
    g.add_argument("--max-nodes", type=int, default=None, help="static: node budget (64)")
    g.add_argument("--expand-top-k", dest="top_k_expand", type=int, default=None, help="eagle2: frontier width and children per node (8)")
    g.add_argument("--total-tokens", type=int, default=None, help="eagle2: draft tokens kept after reranking (32)")


OPTION_FIELDS = {"k": "k", "depth": "depth", "branching": "branching", "max_nodes": "max_nodes", "top_k_expand": "top_k", "total_tokens": "total_tokens"}
"""CLI dest -> policy field"""


def collect_method_options(args: argparse.Namespace, method: str, strict: bool = True) -> dict:
    """The method options the user set that apply to `method` (strict: an inapplicable one is an error)."""
    from specdec.methods import method_options

    allowed = set(method_options(method))
    chosen = {}
    for dest, field_name in OPTION_FIELDS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if field_name in allowed:
            chosen[field_name] = value
        elif strict:
            flag = "--" + ("expand-top-k" if dest == "top_k_expand" else dest.replace("_", "-"))
            raise SpecDecError(f"{flag} does not apply to --method {method}; it takes {', '.join(sorted(allowed)) or 'no options'}")
    return chosen


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k filter (0 = off)")
    p.add_argument("--seed", type=int, default=None)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="continue a prompt with speculative decoding")
    add_model_args(gen)
    add_method_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", default=None, help="the text to continue")
    gen.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    gen.add_argument("--json", action="store_true", help="print one JSON line: text, token_ids, stats")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    gen.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdec.api import SpeculativeDecoder

    if args.prompt is None and args.prompt_file is None:
        raise SpecDecError("give the text to continue with --prompt TEXT or --prompt-file PATH")
    prompt = args.prompt
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise SpecDecError(f"--prompt-file {args.prompt_file!r} does not exist")
        prompt = path.read_text(encoding="utf-8")
    options = collect_method_options(args, args.method)
    decoder = SpeculativeDecoder.from_pretrained(
        args.target, args.draft, method=args.method, verify=args.verify, device=args.device, dtype=args.dtype, **options
    )
    stream = None
    if args.stream and not args.json:
        print(prompt, end="", flush=True)
        shown: list[int] = []
        printed = [""]

        def stream(row: int, tokens: list[int]) -> None:
            shown.extend(tokens)
            text = decoder.tokenizer.decode(shown, skip_special_tokens=True)
            print(text[len(printed[0]) :], end="", flush=True)
            printed[0] = text

    result = decoder.generate(
        prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stream=stream
    )
    stats = result.stats.summary()
    if args.json:
        keys = ("tau", "acceptance_rate", "tokens_per_s", "steps", "ttft_ms", "tpot_ms")
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": {k: stats[k] for k in keys}}))
        return 0
    if not args.stream:
        print(prompt + result.text)
    else:
        print()
    print(
        f"[{args.method}] {stats['new_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, tau {stats['tau']:.2f}, "
        f"acceptance {stats['acceptance_rate']:.2f}, {stats['steps']} steps, TTFT {stats['ttft_ms']:.0f} ms",
        file=sys.stderr,
    )
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
    pair.add_argument("--target-steps", type=int, default=2000)
    pair.add_argument("--draft-steps", type=int, default=800)
    pair.add_argument("--seq-len", type=int, default=512)
    pair.add_argument("--distill-weight", type=float, default=0.5, help="weight of KL(target||draft) in the draft loss; 0 disables distillation")
    pair.add_argument("--tiny", action="store_true", help="tiny shapes and batches (for tests and smoke runs)")
    pair.set_defaults(func=_cmd_train_pair)


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from specdec.training.corpus import iter_texts, list_sources, split_sources
    from specdec.training.tokenizer import train_tokenizer

    train_files, _ = split_sources(list_sources([Path(c) for c in args.corpus] or None))
    train_tokenizer(iter_texts(train_files), Path(args.out), vocab_size=args.vocab_size)
    print(f"tokenizer saved to {args.out}")
    return 0


def _cmd_train_pair(args: argparse.Namespace) -> int:
    from specdec.training.pair import ModelShape, PairConfig, StageConfig, train_pair

    for name in ("target_steps", "draft_steps", "seq_len"):
        if getattr(args, name) <= 0:
            raise SpecDecError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    if not 0 <= args.distill_weight <= 1:
        raise SpecDecError(f"--distill-weight={args.distill_weight} must be in [0, 1]")
    batch_t, batch_d = (2, 2) if args.tiny else (4, 8)
    cfg = PairConfig(
        out_dir=args.out,
        corpus=list(args.corpus),
        vocab_size=args.vocab_size,
        seed=args.seed,
        target=StageConfig(steps=args.target_steps, batch_size=batch_t, seq_len=args.seq_len, lr=1e-3, warmup_steps=min(50, args.target_steps)),
        draft=StageConfig(
            steps=args.draft_steps, batch_size=batch_d, seq_len=args.seq_len, lr=2e-3, warmup_steps=min(50, args.draft_steps), distill_weight=args.distill_weight
        ),
    )
    if args.tiny:
        cfg.target_shape = ModelShape(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
        cfg.draft_shape = ModelShape(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64)
    summary = train_pair(cfg, tokenizer_dir=Path(args.tokenizer) if args.tokenizer else None)
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_train(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (SpecDecError, FileNotFoundError) as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
