"""LongRoPE frequencies per token (`specdec.models.rope`): a forward whose positions straddle
`original_max_position_embeddings`, and a batch whose rows sit on either side of it, give the
logits transformers gives one token (or one prompt) at a time."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, tiny_any_config
from transformers import AutoModelForCausalLM, DynamicCache

import specdec.models.runner as runner_module
from specdec.cost import CostTable
from specdec.engine import SpeculativeEngine
from specdec.methods import make_policy
from specdec.models.runner import ModelRunner
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule

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


def reencoding_phi3(noise: float = 0.0, seed: int = 0):
    """A tiny Phi-3 with LongRoPE (boundary 32) whose attention is sharpened (query/key/value
    weights x6) so that re-encoding the cache with the long factors changes its greedy tokens."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_any_config("phi3", original_max_position_embeddings=BOUNDARY, **LONGROPE)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(6.0)
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model


REENCODE_PROMPTS = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 28, 31, 32, 33, 10)]
"""prompts below, at (32: re-encoded at once, after the first token) and past (33: long from the prefill on) the boundary"""


def test_phi3_reencodes_where_its_generate_does():
    """The model's generate() re-encodes the sequence when it reaches 33 tokens; so does the runner (`reencode_length`)."""
    assert ModelRunner(reencoding_phi3()).reencode_length == BOUNDARY + 1
    assert ModelRunner(longrope_model()).reencode_length is None  # a LongRoPE Llama's generate() does not re-encode


@pytest.mark.parametrize("static_shapes", [False, True])
def test_phi3_greedy_tokens_equal_generate_across_the_reencoding(static_shapes, monkeypatch):
    """Every tree method, batch sizes 1 and 3 (rolling), rows crossing the boundary mid-step:
    generate()'s greedy tokens, which follow its re-encoded cache. Without the re-encoding (each
    token's own factors over the cache as it was encoded) they differ."""
    target, draft = reencoding_phi3(), reencoding_phi3(noise=0.003)
    with torch.no_grad():
        refs = [
            target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist()
            for p in REENCODE_PROMPTS
        ]
    table = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)
    methods = {"ar": {}, "chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {}, "cast": {"cost_table": table}}

    def decode(method: str, batch_size: int, max_draft_rows: int | None = None) -> tuple[list[list[int]], int]:
        engine = SpeculativeEngine(
            target, make_policy(method, **methods[method]), GreedyRule(), ModelDraftSource(draft, static_shapes=static_shapes),
            eos_token_ids=[EOS], static_shapes=static_shapes, max_draft_rows=max_draft_rows,
        )
        outs = engine.generate(REENCODE_PROMPTS, 24, batch_size=batch_size)
        return [o.token_ids for o in outs], sum(o.stats.accepted_tokens for o in outs)

    accepted = 0
    for method in methods:
        for batch_size in (1, 3):
            tokens, n = decode(method, batch_size)
            assert tokens == refs, f"{method}/B={batch_size}"
            accepted += n
    assert accepted > 200, "the close draft should get tokens accepted, so that trees cross the boundary"
    assert decode("eagle2", 3, max_draft_rows=2)[0] == refs  # rows whose draft prefill is owed when they are re-encoded
    original_init = ModelRunner.__init__

    def without_reencoding(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.reencode_length = None

    monkeypatch.setattr(ModelRunner, "__init__", without_reencoding)
    assert decode("eagle2", 1)[0] != refs
