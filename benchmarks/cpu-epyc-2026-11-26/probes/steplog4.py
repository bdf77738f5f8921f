"""`specdec bench` logging every session step to steps.jsonl: the policy, active rows, drafted and
committed tokens, the record's step_s, the whole `_decode_step`, the prefill (`_fill_rows`) and
the whole `step()` wall time, all in ms.

python steplog4.py bench --prompts stdlib-heldout --methods ar,cast --batch-sizes 4 ...
"""

import json
import sys
import time
from typing import Any

from specdec import engine
from specdec.cli import main

Session = next(c for c in vars(engine).values() if isinstance(c, type) and hasattr(c, "_decode_step"))
LOG = open("steps.jsonl", "w")  # noqa: SIM115 (open for the process's life)
_decode_step, _fill_rows, _step = Session._decode_step, Session._fill_rows, Session.step


def fill_rows(self: Any) -> None:
    t = time.perf_counter()
    _fill_rows(self)
    self._t_fill = getattr(self, "_t_fill", 0.0) + time.perf_counter() - t


def decode_step(self: Any) -> Any:
    t = time.perf_counter()
    record = _decode_step(self)
    self._t_decode = time.perf_counter() - t
    return record


def step(self: Any) -> Any:
    self._t_fill = 0.0
    t = time.perf_counter()
    record = _step(self)
    wall = time.perf_counter() - t
    if record is not None:
        active = record.active
        line = {
            "p": type(self.engine.policy).__name__,
            "n": sum(active),
            "dr": sum(d for d, a in zip(record.drafted, active, strict=True) if a),
            "c": sum(record.committed),
            "s": record.step_s * 1e3,
            "ds": self._t_decode * 1e3,
            "fill": self._t_fill * 1e3,
            "w": wall * 1e3,
        }
        LOG.write(json.dumps(line) + "\n")
    return record


Session._fill_rows, Session._decode_step, Session.step = fill_rows, decode_step, step
sys.exit(main(sys.argv[1:]))
