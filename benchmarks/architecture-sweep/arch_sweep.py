"""Every transformers causal-LM type not in the test lists: build a tiny model; if generate() runs,
either specdec refuses it clearly (SpecDecError from check_causal_lm or the engine) or each method's
greedy output equals generate()'s. Prints one line per type."""
import signal
import sys
import traceback

sys.path.insert(0, "tests")
import torch
from conftest import ARCHS, EOS, MORE_ARCHS, WIDE_ARCHS, tiny_any_config
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M

from specdec.cost.table import CostTable
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.models.loading import check_causal_lm
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

TABLE = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47], [3, 4]]
METHODS = {"chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {"max_nodes": 12}, "cast": {"cost_table": TABLE}}
types = sys.argv[1:] or [k for k in M if k not in set(ARCHS) | set(MORE_ARCHS) | set(WIDE_ARCHS)]

def alarm(*_):
    raise TimeoutError("timeout")
signal.signal(signal.SIGALRM, alarm)

def tiny(t, seed, noise=0.0):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_any_config(t)).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(6.0)
        for p in m.parameters():
            p.add_(noise * torch.randn_like(p))
    return m

for t in types:
    signal.alarm(120)
    try:
        try:
            target, draft = tiny(t, 0), tiny(t, 0, 0.005)
            with torch.no_grad():
                refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        except Exception as e:
            print(f"{t}: SKIP (no tiny model/generate: {type(e).__name__}: {str(e)[:100]})", flush=True)
            continue
        try:
            check_causal_lm(target.config, t)
        except SpecDecError as e:
            print(f"{t}: REFUSED {str(e)[:150]}", flush=True)
            continue
        res = []
        for meth, opts in METHODS.items():
            for bs in (1, 2):
                try:
                    eng = SpeculativeEngine(target, make_policy(meth, **opts), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
                    outs = eng.generate(PROMPTS, 16, batch_size=bs)
                    ok = [o.token_ids for o in outs] == refs
                    res.append(f"{meth}/B{bs}:{'ok' if ok else 'MISMATCH'}({sum(o.stats.accepted_tokens for o in outs)})")
                except SpecDecError as e:
                    res.append(f"{meth}/B{bs}:refused({str(e)[:120]})")
                    break
        print(f"{t}: distinct {[len(set(r)) for r in refs]} " + " ".join(res), flush=True)
    except Exception as e:
        print(f"{t}: CRASH {type(e).__name__}: {str(e)[:200]}", flush=True)
        traceback.print_exc(limit=3, file=sys.stderr)
    finally:
        signal.alarm(0)
