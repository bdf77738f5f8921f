"""AR decode of the bundled target through ModelRunner: eager dynamic, eager static, compiled static
(KV storage marked as static addresses), with the KV storage as specdec lays it out or split per layer
("per-layer") and into separate keys and values ("split-kv"). Usage: compile_probe.py B compile [per-layer [split-kv]] [profile]"""
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from specdec.bundled import bundled_target
from specdec.models.runner import ModelRunner

torch.manual_seed(0)
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(bundled_target(), dtype=torch.float32).eval()
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
STEPS = 64
prompt = torch.randint(5, 1000, (B, 120))


def run(runner: ModelRunner, label: str) -> list[torch.Tensor]:
    runner.reset(B)
    logits = runner.prefill(prompt, torch.ones_like(prompt))
    last = logits if logits.dim() == 2 else logits[:, -1]
    tok = last.argmax(-1, keepdim=True)
    outs, times = [], []
    one = torch.ones(B, 1, 1, dtype=torch.bool)
    keep, keep_valid = torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool)
    for _ in range(STEPS):
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = runner.forward(tok, runner.committed_len()[:, None], one)
        runner.commit(keep, keep_valid)
        times.append(time.perf_counter() - t0)
        outs.append(logits[:, -1])
        tok = logits[:, -1].argmax(-1, keepdim=True)
    times.sort()
    print(f"{label}: median {1e3 * times[len(times) // 2]:.2f} ms, first {1e3 * max(times):.0f} ms", flush=True)
    return outs


ref = run(ModelRunner(model), "eager dynamic")
run(ModelRunner(model), "eager dynamic again")
st = ModelRunner(model, static_shapes=True)
eager_static = run(st, "eager static")
if "per-layer" in sys.argv:  # every layer its own storage tensor (SlotCache.extra), no views of one shared storage
    from specdec.models import runner as runner_mod

    def allocate(self, index, key_states, value_states):
        layout = (key_states.shape[1], key_states.shape[3], value_states.shape[1], value_states.shape[3])
        b, h, d = key_states.shape[0], max(layout[0], layout[2]), max(layout[1], layout[3])
        self.extra[index], self.extra_layouts[index] = self._zeros((2, b, h, self.capacity, d), key_states), layout

    runner_mod.SlotCache._allocate_layer = allocate
    if "split-kv" in sys.argv:  # keys and values as separate tensors too
        def allocate_kv(self, index, key_states, value_states):
            b, h, d = key_states.shape[0], key_states.shape[1], key_states.shape[3]
            self.extra[index] = torch.zeros((b, h, self.capacity, d), dtype=key_states.dtype)
            self.extra[index + 1000] = torch.zeros((b, h, self.capacity, d), dtype=key_states.dtype)
            self.extra_layouts[index] = None

        def kv(self, index):
            return self.extra[index], self.extra[index + 1000]

        runner_mod.SlotCache._allocate_layer = allocate_kv
        runner_mod.SlotCache.kv = kv
        runner_mod.SlotCache.tensors = lambda self: [(t, 0, 2) for t in self.extra.values()]

        def map_tensors(self, fn):
            self.extra = {i: fn(t, 0, 2) for i, t in self.extra.items()}
            for t in self.extra.values():
                self.capacity, self.rows = t.shape[2], t.shape[0]
                break

        runner_mod.SlotCache.map_tensors = map_tensors
if "compile" in sys.argv:
    cr = ModelRunner(model, static_shapes=True)
    orig = cr._call_static
    compiled = torch.compile(orig, dynamic=False, fullgraph=False)

    def call(buf, keep, inputs):
        for t, _, _ in cr._cache().tensors():
            torch._dynamo.mark_static_address(t)
        return compiled(buf, keep, inputs) if keep == 0 and not inputs else orig(buf, keep, inputs)

    cr._call_static = call
    t0 = time.perf_counter()
    out = run(cr, "compiled static (1st)")
    print(f"  first run incl. compile {time.perf_counter() - t0:.1f} s")
    out = run(cr, "compiled static (2nd)")
    print("max |diff| vs eager dynamic:", max((a - b).abs().max().item() for a, b in zip(out, ref, strict=True)))
if "profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(cr, "compiled static (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
