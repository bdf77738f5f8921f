"""LongRoPE frequencies per token (`specdec.models.rope`): a forward whose positions straddle
`original_max_position_embeddings`, and a batch whose rows sit on either side of it, give the
logits transformers gives one token (or one prompt) at a time."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_any_config
from transformers import AutoModelForCausalLM, DynamicCache

import specdec.models.runner as runner_module
from specdec.models.runner import ModelRunner

BOUNDARY = 32
LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0 + i for i in range(8)],
        "original_max_position_embeddings": BOUNDARY,
    },
    "max_position_embeddings": 256,
}


def longrope_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_any_config("llama", **LONGROPE)).eval()


IDS = torch.randint(3, 90, (1, 44), generator=torch.Generator().manual_seed(1))


def sequential_logits(start: int, stop: int) -> torch.Tensor:
    """[stop - start, V]: transformers' logits at positions start..stop-1, one token a forward after a prefill of IDS[:start]."""
    model = longrope_model()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS[:, :start], cache=cache, use_cache=True)
        return torch.stack([model(IDS[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1] for t in range(start, stop)])


def chain_logits(static_shapes: bool) -> torch.Tensor:
    """[8, V]: the runner's logits at positions 28..35 (the boundary is 32), from one forward of the root (27) and 8 chained tokens."""
    runner = ModelRunner(longrope_model(), static_shapes=static_shapes)
    runner.prefill(IDS[:, :27], torch.ones(1, 27, dtype=torch.long))
    visibility = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None]
    return runner.forward(IDS[:, 27:36], torch.arange(27, 36)[None], visibility)[0, 1:]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_forward_across_the_longrope_boundary_matches_one_token_at_a_time(static_shapes, monkeypatch):
    reference = sequential_logits(28, 36)
    assert torch.allclose(chain_logits(static_shapes), reference, atol=1e-5)
    # the model's own rule (one frequency set for the forward, by its largest position) is measurably off
    monkeypatch.setattr(runner_module.LongRopeSelector, "for_model", classmethod(lambda cls, model: None))
    assert (chain_logits(static_shapes) - reference).abs().max() > 1e-3


def test_a_prefill_picks_frequencies_by_each_rows_prompt():
    """Left-padded rows of 40 tokens (past the boundary: long factors everywhere, as its own prefill
    forward would) and 12 tokens (short): each row's last logits equal its prompt forwarded alone."""
    model = longrope_model()
    long_row, short_row = IDS[0, :40], IDS[0, 5:17]
    with torch.no_grad():
        alone = [model(row[None]).logits[0, -1] for row in (long_row, short_row)]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    ids[0], mask[0] = long_row, 1
    ids[1, 28:], mask[1, 28:] = short_row, 1
    logits = ModelRunner(model).prefill(ids, mask, dense=False)
    for row in range(2):
        assert torch.allclose(logits[row], alone[row], atol=1e-5), row


def test_generate_on_the_same_model_keeps_transformers_rule():
    """Outside the runner's forwards the wrapped module behaves as transformers' own (the bench's
    Hugging Face peers run on the same model object)."""
    model = longrope_model()
    with torch.no_grad():
        before = model(IDS[:, :36]).logits
    ModelRunner(model)  # installs the per-token selection on this model's rotary module
    with torch.no_grad():
        after = model(IDS[:, :36]).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize(("model_type", "warned"), [("phi3", True), ("llama", False)])
def test_phi3s_reencoding_at_the_boundary_is_named(model_type, warned, caplog):
    """Phi-3's generate() re-encodes the whole sequence once it passes the boundary, which specdec
    does not: loading one says so; a LongRoPE model without that rule gets no warning."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_any_config(model_type, original_max_position_embeddings=BOUNDARY, **LONGROPE)).eval()
    with caplog.at_level("WARNING", logger="specdec.models.rope"):
        ModelRunner(model)
    assert ("re-encodes the whole sequence" in caplog.text) is warned
