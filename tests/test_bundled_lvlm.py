"""The bundled LVLM pair: found without paths, answers about the example scene, and every
speculative method reproduces the target's own greedy output on the scenario prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts
from specdec.cli import main
from specdec.models.loading import BUNDLED_LVLM, bundled_lvlm_draft, bundled_lvlm_target
from specdec.multimodal.inputs import MultimodalPrompt
from specdec.sampling import SamplingParams

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "scene.png"
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder.from_pretrained(bundled_lvlm_target(), bundled_lvlm_draft(), method="chain", k=4, device="cpu")


def _reference(target, prompt: MultimodalPrompt, max_new: int) -> list[int]:
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.model_inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_bundle_is_complete():
    for name in ("target", "draft"):
        assert (BUNDLED_LVLM / name / "config.json").is_file()
        assert (BUNDLED_LVLM / name / "processor_config.json").is_file() or (BUNDLED_LVLM / name / "preprocessor_config.json").is_file()
    log = json.loads((BUNDLED_LVLM / "train_log.json").read_text())
    assert log["target_params"] > 5 * log["draft_params"]


def test_cli_generate_with_an_image_and_no_paths(capsys):
    assert main(["generate", "--image", str(EXAMPLE), "--prompt", PROMPT, "--max-new-tokens", "40", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the example scene: a yellow diamond on the right, a green square at the bottom left, a purple square at the bottom right
    assert out["text"].strip().startswith("There is") and "on the right" in out["text"] and "bottom left" in out["text"]
    assert out["stats"]["tau"] >= 1.0


@pytest.mark.parametrize("scenario", ["scenes-first-turn", "scenes-second-turn", "scenes-ood"])
def test_greedy_equals_target_on_scenarios(decoder, scenario):
    items = load_prompts(scenario, limit=3)
    prompts = [decoder.encode(item.turns[0], item.images) for item in items]
    refs = [_reference(decoder.target, p, 24) for p in prompts]
    for method, options in (("chain", {"k": 4}), ("dynatree", {}), ("eagle2", {})):
        dec = SpeculativeDecoder(decoder.target, decoder.tokenizer, decoder.draft, method=method, processor=decoder.processor, **options)
        outs = dec.generate_ids(prompts, 24, SamplingParams(), verify="greedy", batch_size=2)
        assert [o.token_ids for o in outs] == refs, (scenario, method)
