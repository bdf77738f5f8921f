"""Model-card figures for the bundled LVLM pair (`specdec train evaluate-lvlm`).

Exact-match accuracy of each model on the evaluation split of every scene task, answering
with the image and without it (each `<image>` replaced by a newline: the text-only view),
plus sizes and the latency of one decoding step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from specdec.engine import SpeculativeEngine
from specdec.hostwork import sync_device
from specdec.methods import make_policy
from specdec.models.runner import ModelRunner
from specdec.multimodal.inputs import MultimodalPrompt, encode_multimodal
from specdec.multimodal.scenes import format_conversation, generate_examples
from specdec.multimodal.views import TextOnlyView
from specdec.verification import GreedyRule

EVAL_TASKS = ("describe", "count", "colour", "shape", "where", "read", "change", "text", "followup")


def _answers(model, prompts, eos: list[int], pad: int, max_new_tokens: int, tokenizer) -> list[str]:
    engine = SpeculativeEngine(model, make_policy("ar"), GreedyRule(), None, eos_token_ids=eos, pad_token_id=pad)
    outs = engine.generate(prompts, max_new_tokens, batch_size=16)
    return [tokenizer.decode(o.token_ids, skip_special_tokens=True).strip() for o in outs]


@torch.inference_mode()
def step_latency_ms(model, prompt: MultimodalPrompt, repeats: int = 40) -> float:
    """Median time of one single-token decoding step after prefilling `prompt` (batch 1)."""
    runner = ModelRunner(model)
    ids = torch.tensor([prompt.token_ids], device=runner.device)
    runner.prefill(ids, torch.ones_like(ids), {k: v.to(runner.device) for k, v in prompt.model_inputs.items()})
    token = ids[:, -1:]
    pos = runner.committed_len()[:, None]
    vis = torch.ones(1, 1, 1, dtype=torch.bool, device=runner.device)
    times = []
    for _ in range(repeats):
        sync_device(runner.device)
        t0 = time.perf_counter()
        runner.forward(token, pos, vis)
        sync_device(runner.device)  # a GPU forward only queues its kernels
        times.append(time.perf_counter() - t0)
        runner.rollback()
    return 1000 * statistics.median(times[5:])


def evaluate_lvlm(target, draft, processor, per_task: int = 40, seed: int = 7, max_new_tokens: int = 40) -> dict[str, Any]:
    tokenizer = processor.tokenizer
    eos = [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id
    text_view = TextOnlyView(tokenizer)
    results: dict[str, Any] = {"per_task": per_task, "seed": seed, "tasks": {}}
    for task in EVAL_TASKS:
        examples = generate_examples(per_task, seed, "eval", tasks=[task])
        prompts, references = [], []
        for ex in examples:
            last = len(ex.turns) - 1
            text = format_conversation(ex.turns, upto=last)
            prompts.append(encode_multimodal(processor, text, ex.images()))
            references.append(ex.turns[last][1])
        blind = [text_view.encode(p)[0] for p in prompts]
        row: dict[str, float] = {}
        for name, model in (("target", target), ("draft", draft)):
            with_image = _answers(model, prompts, eos, pad, max_new_tokens, tokenizer)
            without = _answers(model, blind, eos, pad, max_new_tokens, tokenizer)
            row[f"{name}_with_image"] = sum(a == r for a, r in zip(with_image, references, strict=True)) / len(references)
            row[f"{name}_without_image"] = sum(a == r for a, r in zip(without, references, strict=True)) / len(references)
        results["tasks"][task] = row
    image_tasks = [t for t in EVAL_TASKS if t != "text"]
    for key in ("target_with_image", "target_without_image", "draft_with_image", "draft_without_image"):
        results[f"mean_{key}"] = statistics.mean(results["tasks"][t][key] for t in image_tasks)
    describe = generate_examples(1, seed, "eval", tasks=["describe"])[0]
    sample = encode_multimodal(processor, format_conversation(describe.turns, upto=0), describe.images())
    results["step_ms"] = {"target": step_latency_ms(target, sample), "draft": step_latency_ms(draft, sample), "context_tokens": len(sample)}
    results["params"] = {"target": sum(p.numel() for p in target.parameters()), "draft": sum(p.numel() for p in draft.parameters())}
    return results
