"""specdec ar/eagle2 on the text-only prompt alone vs the model's own generate (usage: text_only.py TYPE)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep import MAX_NEW, METHODS, build, innermost_specdec_frame, prompts_for, reference

from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

spec, model = build(sys.argv[1])
prompts, _ = prompts_for(spec, model)
ids = prompts[2][0]
ref = reference(model, spec, ids, {})
for m in ("ar", "eagle2"):
    try:
        eng = SpeculativeEngine(model, make_policy(m, **METHODS[m]), GreedyRule(), ModelDraftSource(model), eos_token_ids=[spec.eos], pad_token_id=spec.pad)
        out = eng.generate([ids], MAX_NEW)[0].token_ids
        print(m, "EQUAL" if out == ref else f"DIFF got={out} ref={ref}")
    except Exception as e:
        print(m, type(e).__name__, str(e)[:200], innermost_specdec_frame(sys.exc_info()[2]))
