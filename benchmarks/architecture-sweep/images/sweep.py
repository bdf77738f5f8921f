"""One VLM type: build tiny random model, check its own generate() with an image, then compare
specdec (ar/chain/eagle2, batch sizes 1 and 2) against per-prompt greedy generate().

usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/architecture-sweep/images/sweep.py TYPE [--stage build|ref|all]
Prints a final line `RESULT {json}`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

import torch

torch.set_num_threads(1)

from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specs import SPECS, default_spec  # noqa: E402

MAX_NEW = 12
METHODS = {"ar": {}, "chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}}
TEXT_A = [5, 6, 7]
TEXT_B = [8, 9]
TEXT_C = [11, 12, 13, 14]
TEXT_ONLY = [20, 21, 22, 23, 24, 25, 26]


def scale_head(model, factor=7.0):
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    with torch.no_grad():
        if head is not None and emb is not None and head.weight.data_ptr() == emb.weight.data_ptr():
            # tied: untie by replacing the head weight
            head.weight = torch.nn.Parameter(emb.weight.detach().clone() * factor)
        elif head is not None:
            head.weight.mul_(factor)


def count_tokens_by_error(model, spec, pixel_extra):
    """Run forward with 1 image token; parse 'tokens: X, features: Y' from the error."""
    ids = spec.wrap(TEXT_A, 1)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **pixel_extra, **spec.ref_extra(ids, True))
    except Exception as err:  # noqa: BLE001
        m = re.search(r"tokens:\s*(\d+),\s*features:?\s*(\d+)", str(err))
        if not m:
            raise
        y = int(m.group(2))
        hidden = model.config.get_text_config().hidden_size
        for cand in (y, y // hidden):
            ids = spec.wrap(TEXT_A, cand)
            try:
                with torch.no_grad():
                    model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **pixel_extra, **spec.ref_extra(ids, True))
                return cand
            except Exception:  # noqa: BLE001
                pass
        raise
    return 1


def build(mtype):
    spec = SPECS.get(mtype, default_spec)(mtype)
    torch.manual_seed(0)
    if spec.model_fn is not None:
        model = spec.model_fn()
    else:
        cfg = AutoConfig.for_model(spec.mtype, **spec.config_kwargs)
        spec.post_config(cfg)
        model = AutoModelForImageTextToText.from_config(cfg)
    model = model.eval()
    scale_head(model, spec.head_scale)
    spec.post_build(model)
    return spec, model


def prompts_for(spec, model):
    torch.manual_seed(1)
    p1 = spec.image_inputs(model, 1)
    torch.manual_seed(2)
    p2 = spec.image_inputs(model, 2)
    n = spec.n_image_tokens
    if n is None:
        n = [count_tokens_by_error(model, spec, p1), count_tokens_by_error(model, spec, p2)]
    elif isinstance(n, int):
        n = [n, n]
    ids1 = spec.wrap(TEXT_A, n[0]) + TEXT_B
    ids2 = TEXT_C + spec.wrap(TEXT_B, n[1]) + [15, 16, 17]
    text = spec.text_prefix + TEXT_ONLY
    p1 = {**p1, **spec.prompt_extra(ids1)}
    p2 = {**p2, **spec.prompt_extra(ids2)}
    return [(ids1, p1), (ids2, p2), (text, {})], n


def reference(model, spec, ids, extra):
    t = torch.tensor([ids])
    extra = {**extra, **spec.ref_extra(ids, bool(extra))}
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=spec.eos, pad_token_id=spec.pad, min_new_tokens=0)
    with torch.no_grad():
        try:
            out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), **extra, **kw)
        except TypeError as err:
            if "multiple values" not in str(err):
                raise
            kw.pop("eos_token_id")
            kw.pop("pad_token_id")  # BLIP's generate sets them itself
            out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), **extra, **kw)
    return out[0, t.shape[1]:].tolist()


def innermost_specdec_frame(tb):
    frames = [f for f in traceback.extract_tb(tb) if "/specdec/" in f.filename]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename.split('/work/main/')[-1]}:{f.lineno} in {f.name}: {f.line}"


def main():
    mtype = sys.argv[1]
    stage = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else "all"
    result = {"type": mtype}
    try:
        spec, model = build(mtype)
        prompts, n = prompts_for(spec, model)
        result["n_image_tokens"] = n
        result["prompt_lens"] = [len(p[0]) for p in prompts]
        result["extra_keys"] = {k: list(v.shape) if hasattr(v, "shape") else repr(v)[:60] for k, v in prompts[0][1].items()}
        refs = [reference(model, spec, ids, extra) for ids, extra in prompts[:2]]
        try:
            refs.append(reference(model, spec, *prompts[2]))
        except Exception as err:  # noqa: BLE001
            result["text_only_ref_failed"] = f"{type(err).__name__}: {str(err)[:200]}"
            prompts = prompts[:2]
    except Exception as err:  # noqa: BLE001
        result["class"] = "NOT-BUILT"
        result["reason"] = f"{type(err).__name__}: {str(err)[:300]}"
        result["tb"] = traceback.format_exc()[-2500:]
        print("RESULT " + json.dumps(result))
        return
    result["refs"] = refs
    result["images_read"] = refs[0] != refs[1]
    try:  # image sensitivity: same ids (prompt 0), the other image -> last-position logits differ by how much?
        if True:
            ids1 = prompts[0][0]
            torch.manual_seed(3)  # another image of prompt 0's shape
            alt = {**spec.image_inputs(model, 1), **spec.prompt_extra(ids1)}
            def last_logits(extra):
                t = torch.tensor([ids1])
                with torch.no_grad():
                    return model(input_ids=t, attention_mask=torch.ones_like(t), **extra, **spec.ref_extra(ids1, True)).logits[0, -1]
            a, b = last_logits(prompts[0][1]), last_logits(alt)
            result["image_logit_delta"] = round((a - b).abs().max().item(), 4)
            result["image_changes_ref"] = reference(model, spec, ids1, alt) != refs[0]
    except Exception as err:  # noqa: BLE001
        result["image_logit_delta"] = f"n/a ({type(err).__name__}: {str(err)[:80]})"
    if stage in ("build", "ref"):
        result["class"] = "BUILT"
        print("RESULT " + json.dumps(result))
        return

    from specdec.engine import SpeculativeEngine
    from specdec.errors import SpecDecError
    from specdec.methods import make_policy
    from specdec.multimodal.inputs import MultimodalPrompt
    from specdec.sources import ModelDraftSource
    from specdec.verification import GreedyRule

    if "--force-multimodal" in sys.argv:  # probe only: treat a model without vision_config as multimodal
        import specdec.engine
        import specdec.sources.model
        specdec.engine.is_multimodal = lambda m: True
        specdec.sources.model.is_multimodal = lambda m: True
        result["forced_multimodal"] = True
    mprompts = [MultimodalPrompt(list(ids), dict(extra)) if extra else list(ids) for ids, extra in prompts]
    runs = {}
    refused = crash = None
    methods = METHODS
    static_shapes = "--trees-static" in sys.argv  # DynaTree and CAST (a GPU-like cost table) with static shapes instead
    if static_shapes:
        from specdec.cost import CostTable

        table = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)
        methods = {"eagle2": METHODS["eagle2"], "dynatree": {}, "cast": {"cost_table": table}}
    for method, opts in methods.items():
        for bs in (1, 2):
            key = f"{method}/bs{bs}"
            try:
                eng = SpeculativeEngine(model, make_policy(method, **opts), GreedyRule(), ModelDraftSource(model, static_shapes=static_shapes),
                                        eos_token_ids=[spec.eos], pad_token_id=spec.pad, static_shapes=static_shapes)
                outs = eng.generate(mprompts, MAX_NEW, batch_size=bs)
                toks = [o.token_ids for o in outs]
                diffs = []
                for i, (o, r) in enumerate(zip(toks, refs, strict=True)):
                    if o != r:
                        pos = next((j for j, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), min(len(o), len(r)))
                        diffs.append({"prompt": i, "first_diff": pos, "got": o, "ref": r})
                runs[key] = {"ok": not diffs, "diffs": diffs}
            except SpecDecError as err:
                runs[key] = {"refused": str(err)[:300]}
                refused = refused or str(err)
            except Exception as err:  # noqa: BLE001
                tb = sys.exc_info()[2]
                runs[key] = {"crash": f"{type(err).__name__}: {str(err)[:300]}", "frame": innermost_specdec_frame(tb),
                             "specdec_frames": [f"{f.filename.split('/work/main/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(tb) if "/specdec/" in f.filename],
                             "tb": traceback.format_exc()[-3000:]}
                crash = crash or runs[key]
    result["runs"] = runs
    if crash:
        result["class"] = "CRASH"
    elif refused and all("refused" in r for r in runs.values()):
        result["class"] = "REFUSED"
        result["reason"] = refused[:150]
    elif all(r.get("ok") for r in runs.values()):
        result["class"] = "EXACT"
    else:
        result["class"] = "MISMATCH" if not refused else "MIXED"
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()


def last_logits(model, ids, extra, mask=None):
    """[B, V] the model's logits at the last position of `ids` (a list of rows) with inputs `extra`"""
    t = torch.tensor(ids)
    with torch.no_grad():
        return model(input_ids=t, attention_mask=mask if mask is not None else torch.ones_like(t), **extra).logits[:, -1]


def two_image_batch(mtype):
    """The sweep's two image prompts of `mtype` as one left-padded batch, for the padding probes:
    (model, inputs of prompt 1 and 2, ids [2, L], mask [2, L], each prompt alone's last logits [2, V])."""
    spec, model = build(mtype)
    prompts, _ = prompts_for(spec, model)
    (i1, e1), (i2, e2) = prompts[0], prompts[1]
    alone = torch.cat([last_logits(model, [i1], e1), last_logits(model, [i2], e2)])
    width = max(len(i1), len(i2))
    ids = [[0] * (width - len(i1)) + i1, [0] * (width - len(i2)) + i2]
    mask = torch.tensor([[0] * (width - len(i1)) + [1] * len(i1), [0] * (width - len(i2)) + [1] * len(i2)])
    return model, e1, e2, ids, mask, alone
