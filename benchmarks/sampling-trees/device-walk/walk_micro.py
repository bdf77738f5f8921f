"""Time SamplingRule.verify host vs device on real EAGLE-2 / DynaTree trees of the bundled pair at T=1."""
import sys, time, torch
from specdec.api import SpeculativeDecoder
from specdec.sampling import SamplingParams
from specdec.verification import SamplingRule
torch.manual_seed(0)
captured = []
for method in sys.argv[1].split(","):
    for b in (1, 4):
        dec = SpeculativeDecoder.from_pretrained(method=method)
        eng = dec.engine("sampling")
        rule = SamplingRule(walk="host")
        orig = rule.verify
        cap = []
        def spy(tree, logits, params, gen, _orig=orig, _cap=cap):
            _cap.append((tree, logits.clone(), params))
            return _orig(tree, logits, params, gen)
        rule.verify = spy
        eng.rule = rule
        eng.generate([dec.encode("import os\nimport sys\n\ndef main():\n    ")] * b, 32, SamplingParams(temperature=1.0), seed=0)
        res = {}
        for walk in ("host", "device"):
            r = SamplingRule(walk=walk); g = torch.Generator().manual_seed(0)
            for tree, logits, params in cap[:3]: r.verify(tree, logits, params, g)
            t0 = time.perf_counter()
            for _ in range(3):
                for tree, logits, params in cap: r.verify(tree, logits, params, g)
            res[walk] = (time.perf_counter() - t0) / (3 * len(cap)) * 1000
        print(f"{method} B={b} nodes={cap[0][0].num_nodes} K={cap[0][0].max_children} host {res['host']:.2f} ms device {res['device']:.2f} ms")
