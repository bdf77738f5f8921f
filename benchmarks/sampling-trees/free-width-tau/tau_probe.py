"""τ (new tokens per verification step) of method specs on the bundled pair at one temperature,
over the first N stdlib-heldout prompts taken evenly, for several seeds; no timing (τ does not
depend on the machine). Run from the repository root:

    python benchmarks/sampling-trees/free-width-tau/tau_probe.py T N_PROMPTS TOKENS SEEDS method[:k=v,...] ...

e.g. `... 1.0 16 96 2 chain eagle2 dynatree dynatree:free_tokens=64`.
"""

from __future__ import annotations

import json
import sys

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import bundled_heldout_path


def parse(spec: str) -> tuple[str, dict[str, object]]:
    method, _, opts = spec.partition(":")
    options: dict[str, object] = {}
    for item in filter(None, opts.split(",")):
        key, value = item.split("=")
        for kind in (int, float):
            try:
                options[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            options[key] = value
    return method, options


def main() -> None:
    temperature, n, tokens, seeds = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with open(bundled_heldout_path()) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    prompts = prompts[:: max(1, len(prompts) // n)][:n]
    rows = []
    for spec in sys.argv[5:]:
        method, options = parse(spec)
        decoder = SpeculativeDecoder.from_pretrained(method=method, **options)
        new = steps = drafted = 0
        for seed in range(seeds):
            for result in decoder.generate(prompts, max_new_tokens=tokens, temperature=temperature, seed=seed, batch_size=1):
                new, steps, drafted = new + result.stats.new_tokens, steps + result.stats.steps, drafted + result.stats.drafted_tokens
        rows.append({"method": spec, "tau": new / steps, "drafted_per_step": drafted / steps, "steps": steps})
        print(f"{spec:40s} tau {new / steps:.3f} drafted/step {drafted / steps:.1f} steps {steps}", flush=True)
    print(json.dumps({"temperature": temperature, "prompts": n, "tokens": tokens, "seeds": seeds, "rows": rows}))


if __name__ == "__main__":
    main()
