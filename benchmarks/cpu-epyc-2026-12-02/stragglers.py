"""How long a grouped bench call waits for its slowest row: each call's wall time over the mean
of its rows' own finish times (a row's time to first token plus its time per output token times
its later tokens), median over calls, per method and batch size.

    python benchmarks/cpu-epyc-2026-12-02/stragglers.py benchmarks/cpu-epyc-2026-12-02/b4-b16-8-repeats

Rows of a group start together; AR's rows advance one token a step each, so they end together
(about 1.00); a speculative method's rows commit different counts a step, so a group ends with its
slowest row while the others' slots idle. The reports' TPOT is per row and does not show that wait;
tokens/s (all tokens over all wall time) does.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    run = Path(sys.argv[1])
    for results in sorted(run.glob("batch-*/results.json"), key=lambda p: int(p.parent.name.split("-")[1])):
        data = json.loads(results.read_text())
        batch = results.parent.name.split("-")[1]
        labels = dict.fromkeys(r["label"] for r in data["records"])
        for label in labels:
            ratios = []
            for record in (r for r in data["records"] if r["label"] == label):
                tpots = iter(record["row_tpot_s"])  # (rows with more than one token only)
                finishes = [
                    ttft + (next(tpots) * (len(out) - 1) if len(out) > 1 else 0.0)
                    for ttft, out in zip(record["row_ttft_s"], record["outputs"], strict=True)
                ]
                ratios.append(record["wall_s"] / statistics.mean(finishes))
            print(f"B = {batch:>2} {label:10s} calls {len(ratios):3d}  wall / mean row finish: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
