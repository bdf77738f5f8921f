"""What capturing whole drafting levels as CUDA graphs (SPECDEC_CAPTURE_LEVELS=1,
`specdec.drafting.levels`) does to a decoding step: the same decoder with level capture on and
off, in alternating rounds of one process, with each round's drafts checked equal to the other
mode's (the same tokens and the same steps: greedy, or sampled with one seed, as captured
levels draw what op-by-op levels draw).

Built on the CPU (2026-11-25, fourth session) and checked there by emulated replay; on the CPU
the host-launched ops a step outside graphs fell by about half (`benchmarks/captured-levels/`).
Whether an H100 step gets faster is what this script measures.

    python benchmarks/gpu/levels_ab.py --target PAIR/target --draft PAIR/draft \
        --prompts PAIR/prompts.jsonl --methods chain,eagle2,static --device cuda --out OUT/levels \
        [--temperature 1]

With `--switch walks` the same A/B for captured verification walks (SPECDEC_CAPTURE_WALKS,
`specdec.verification.captured`: sampled trees' traversal tests on the device as graph replays;
use it with --temperature above 0), drafting levels left at their default.

Writes `summary.md` and `summary.json` under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
from gpu_common import add_pair_arguments, method_items, read_prompts, timed_generate

from specdec.api import SpeculativeDecoder
from specdec.models import runner as runner_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, methods="chain,eagle2,static", num_prompts=12)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, every call seeded alike")
    ap.add_argument("--switch", default="levels", choices=("levels", "walks"), help="what is captured or not: drafting levels (SPECDEC_CAPTURE_LEVELS) or verification walks (SPECDEC_CAPTURE_WALKS)")
    args = ap.parse_args()
    env = runner_module.CAPTURE_LEVELS_ENV if args.switch == "levels" else runner_module.CAPTURE_WALKS_ENV
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.num_prompts)
    device = torch.device(args.device)
    sampling = {"temperature": args.temperature, "seed": 0}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "batch_size": args.batch_size, "temperature": args.temperature, "methods": {}}
    lines = [f"| method | {args.switch} | τ | tok/s | ms/step | draft ms/step | {args.switch[:-1]} graphs (captures, replays) | same tokens and steps |", "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for spec, method, opts, _ in method_items(args.methods):
        dec = SpeculativeDecoder.from_pretrained(args.target, args.draft, method=method, device=args.device, **opts)
        reference: dict[str, Any] = {}
        for mode in ("on", "off"):  # warm: graphs (level graphs too), costs
            os.environ[env] = "1" if mode == "on" else "0"
            for _ in range(2):
                dec.generate(prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, **sampling)
        per_mode: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        models = {id(m): m for m in (dec.target, dec.draft) if m is not None}  # shared, never copied (a cost resolver holds them)
        learned = copy.deepcopy(dec.policy, dict(models))  # adaptive policies learn across calls: every timed call starts from this state
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                os.environ[env] = "1" if mode == "on" else "0"  # read as each call makes its engine
                dec.policy = copy.deepcopy(learned, dict(models))
                results, metrics = timed_generate(dec, prompts, args.max_new_tokens, args.batch_size, device, **sampling)
                fingerprint = ([x.token_ids for x in results], [x.stats.steps for x in results])
                reference.setdefault("fingerprint", fingerprint)
                model = dec.draft if args.switch == "levels" else dec.target
                shared = runner_module.shared_state(model) if model is not None else None
                graphs = None if shared is None else shared.level_graphs if args.switch == "levels" else shared.walk_graphs
                per_mode[mode].append(
                    {
                        **metrics,
                        "graph_captures": graphs.captures if graphs is not None else 0,
                        "graph_replays": graphs.replays if graphs is not None else 0,
                        "graphs_failed": graphs.failed if graphs is not None else None,
                        "same": fingerprint == reference["fingerprint"],
                    }
                )
        summary = {}
        for mode, rows in per_mode.items():
            med = {key: statistics.median(row[key] for row in rows) for key in ("tok_per_s", "ms_per_step", "tau", "draft_ms_per_step")}
            last = rows[-1]
            summary[mode] = {"median": med, "rounds": rows}
            same = all(row["same"] for row in rows)
            lines.append(
                f"| {spec} | {mode} | {med['tau']:.2f} | {med['tok_per_s']:.1f} | {med['ms_per_step']:.2f} | {med['draft_ms_per_step']:.2f} | "
                f"{last['graph_captures']}, {last['graph_replays']}{' (failed: ' + str(last['graphs_failed']) + ')' if last['graphs_failed'] else ''} | {'yes' if same else 'NO'} |"
            )
        result["methods"][spec] = summary
        print(lines[-2], lines[-1], sep="\n", flush=True)
        del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.environ.pop(env, None)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(f"{result['device']}, B = {args.batch_size}, T = {args.temperature:g}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.rounds} alternating rounds\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
