"""RoPE types whose frequencies depend on the forward's largest position (dynamic NTK, LongRoPE):
specdec's greedy tokens vs generate()'s when decoding crosses the original context."""
import sys

sys.path.insert(0, "tests")
import torch
from conftest import EOS, tiny_any_config
from transformers import AutoModelForCausalLM

from specdec.cost.table import CostTable
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

TABLE = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)
PROMPTS = [list(range(5, 25)), [10, 11, 12], list(range(40, 70))]
METHODS = {"ar": {}, "chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {"max_nodes": 12}, "cast": {"cost_table": TABLE}}
CASES = {
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, "max_position_embeddings": 32}),
    "phi3-longrope": ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0 + i for i in range(8)], "original_max_position_embeddings": 32}, "original_max_position_embeddings": 32, "max_position_embeddings": 256}),
    "llama-longrope": ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0 + i for i in range(8)], "original_max_position_embeddings": 32}, "max_position_embeddings": 256}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}, "max_position_embeddings": 128}),
}
which = sys.argv[1:] or list(CASES)
for name in which:
    arch, over = CASES[name]
    def tiny(seed, noise=0.0, arch=arch, over=over):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(tiny_any_config(arch, **over)).eval()
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(6.0)
            for p in m.parameters():
                p.add_(noise * torch.randn_like(p))
        return m
    target, draft = tiny(0), tiny(0, 0.005)
    with torch.no_grad():
        refs = [tiny(0).generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    res = []
    for meth, opts in METHODS.items():
        for static in (False, True):
            t = tiny(0)
            eng = SpeculativeEngine(t, make_policy(meth, **opts), GreedyRule(), ModelDraftSource(draft, static_shapes=static), eos_token_ids=[EOS], static_shapes=static, max_context=256)
            outs = eng.generate(PROMPTS, 40, batch_size=1)
            got = [o.token_ids for o in outs]
            first = [next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), None) for g, r in zip(got, refs, strict=True)]
            res.append(f"{meth}{'/s' if static else ''}:{'ok' if got == refs else 'MISMATCH@' + str(first)}({sum(o.stats.accepted_tokens for o in outs)})")
    print(name, "distinct", [len(set(r)) for r in refs], " ".join(res), flush=True)
