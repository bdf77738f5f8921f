"""`specdec bench` logging every session step: policy, active rows, drafted and committed tokens, step_s, _decode_step, prefill (_fill_rows) and whole step() wall ms (to steps.jsonl)."""
import sys, time, collections, atexit, json
from specdec import engine as E
cls = [c for c in vars(E).values() if isinstance(c, type) and hasattr(c, "_decode_step")][0]
LOG = open("steps.jsonl", "w")
ods, ofr = cls._decode_step, cls._fill_rows
def fill(self):
    t = time.perf_counter(); r = ofr(self); self._t_fill = getattr(self, "_t_fill", 0) + time.perf_counter() - t; return r
def ds(self):
    t = time.perf_counter(); rec = ods(self); self._t_ds = time.perf_counter() - t; return rec
cls._fill_rows, cls._decode_step = fill, ds
ost = cls.step
def step(self):
    self._t_fill = 0; t = time.perf_counter(); rec = ost(self); w = time.perf_counter() - t
    if rec is not None:
        a = rec.active
        LOG.write(json.dumps(dict(p=type(self.engine.policy).__name__, n=sum(a), dr=sum(d for d, x in zip(rec.drafted, a) if x), c=sum(rec.committed),
          s=rec.step_s*1e3, ds=self._t_ds*1e3, fill=self._t_fill*1e3, w=w*1e3)) + "\n")
    return rec
cls.step = step
from specdec.cli import main
sys.exit(main(sys.argv[1:]))
