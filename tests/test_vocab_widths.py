"""Draft and target output layers of different widths, one tokenizer (specdec/models/vocab.py).

Qwen2.5-7B's output layer has 152,064 rows and Qwen2.5-0.5B's 151,936 for the same
tokenizer; tiny Qwen2 pairs built that way (both wider than the tokenizer, the draft
narrower or wider than the target) must give:

- the target's own greedy `generate` output, for chains, trees and TABED;
- sampling (T = 0.8) and MARS without errors, tokens inside the target's vocabulary;
- the target's exact output distribution when sampling (chi-square on the joint of the
  first three tokens of a 6-token target, as in test_sampling_distribution.py), with a
  draft of 8 or 5 columns;
- no drafted id at or beyond the tokenizer's length (they get -inf).

The draft's extra rows are scaled up so that an unmasked draft would propose them often:
on the old code these pairs raised a size mismatch (sampling) or an IndexError (a wider
draft).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import sharpen, tiny_config, tiny_model
from distribution import chi2_pvalue, exact_joint
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.api import SpeculativeDecoder
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.models.vocab import VocabFit, fit_draft_inputs, fit_draft_logits, output_width
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.verification import SamplingRule

PAD_TARGET, PAD_DRAFT = 24, 8
"""rows beyond the tokenizer: the target's and the draft's (swapped for a wider draft)"""


def boost_extra_rows(model, start: int, scale: float = 40.0):
    """Make ids >= start the draft's favourites, so an unmasked draft proposes them."""
    with torch.no_grad():
        model.get_output_embeddings().weight[start:].mul_(scale)
    return model


@pytest.fixture(scope="module")
def width_pairs(tiny_pair_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Saved Qwen2 target/draft folders sharing the tiny pair's tokenizer:
    'narrow-draft' (draft has fewer rows than the target) and 'wide-draft' (more)."""
    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    n = len(tok)
    root = tmp_path_factory.mktemp("widths")
    pairs = {}
    for name, (t_pad, d_pad) in {"narrow-draft": (PAD_TARGET, PAD_DRAFT), "wide-draft": (PAD_DRAFT, PAD_TARGET)}.items():
        paths = []
        for role, pad, seed, layers in (("target", t_pad, 0, 2), ("draft", d_pad, 1, 1)):
            torch.manual_seed(seed)
            cfg = tiny_config("qwen2", layers=layers, vocab=n + pad, eos=tok.eos_token_id)
            cfg.pad_token_id = tok.pad_token_id
            cfg.tie_word_embeddings = False
            model = sharpen(AutoModelForCausalLM.from_config(cfg).eval())
            if role == "draft":
                boost_extra_rows(model, n)
            path = root / name / role
            model.save_pretrained(path)
            tok.save_pretrained(path)
            paths.append(path)
        pairs[name] = (paths[0], paths[1])
    return pairs


def test_fit_draft_logits_worked_examples():
    """The module docstring's examples: pad with -inf, slice, mask ids the tokenizer lacks."""
    narrow = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    out = fit_draft_logits(narrow, VocabFit(target_width=7, drafted=4, draft_width=5))
    assert out.tolist() == [[1.0, 2.0, 3.0, 4.0] + [float("-inf")] * 3]
    wide = torch.arange(7.0).reshape(1, 1, 7)  # any leading shape
    out = fit_draft_logits(wide, VocabFit(target_width=5, drafted=4, draft_width=7))
    assert out.shape == (1, 1, 5) and out[0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, float("-inf")]
    assert fit_draft_logits(narrow, None) is narrow
    ids = torch.tensor([3, 5, 6])
    assert fit_draft_inputs(ids, VocabFit(target_width=7, drafted=4, draft_width=5)).tolist() == [3, 0, 0]


def test_vocab_fit_for_pair():
    target, draft = tiny_model("qwen2", 0, vocab=104), tiny_model("qwen2", 1, vocab=96)
    assert output_width(target) == 104 and output_width(draft) == 96
    assert VocabFit.for_pair(target, draft, 90) == VocabFit(target_width=104, drafted=90, draft_width=96)
    assert VocabFit.for_pair(draft, target, 100) == VocabFit(target_width=96, drafted=96, draft_width=104)
    assert VocabFit.for_pair(draft, draft, 96) is None  # same width, every id a token: nothing to do
    assert VocabFit.for_pair(draft, draft, 90) == VocabFit(target_width=96, drafted=90, draft_width=96)


@pytest.mark.parametrize("draft_vocab", [88, 104])
def test_an_engine_over_a_draft_of_another_width_needs_its_vocab_fit(draft_vocab):
    """Without a VocabFit the engine had raised an IndexError inside an embedding at the first
    id past the narrower model's rows; it names the widths and the fix before any work."""
    from specdec.verification import GreedyRule

    target, draft = tiny_model("qwen2", 0, vocab=96), tiny_model("qwen2", 1, vocab=draft_vocab)
    with pytest.raises(SpecDecError, match=rf"the draft model's output layer has {draft_vocab} rows, but the target's logits are 96 wide; pass vocab=VocabFit.for_pair"):
        SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[2])
    fit = VocabFit.for_pair(target, draft, 90)
    out = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), ModelDraftSource(draft, vocab=fit), eos_token_ids=[]).generate([[5, 6, 7]], 8)
    assert len(out[0].token_ids) == 8
    with pytest.raises(SpecDecError, match="vocab must be a specdec.models.vocab.VocabFit or None, got int"):
        ModelDraftSource(draft, vocab=96)


@pytest.mark.parametrize("pair", ["narrow-draft", "wide-draft"])
def test_draft_source_gives_target_width_and_never_drafts_beyond_the_tokenizer(width_pairs, pair):
    target_dir, draft_dir = width_pairs[pair]
    decoder = SpeculativeDecoder.from_pretrained(str(target_dir), str(draft_dir), method="chain", device="cpu")
    n = len(decoder.tokenizer)
    ids = torch.tensor([decoder.encode("def add(a, b):")])
    for params in (SamplingParams(), SamplingParams(temperature=0.8)):
        source = decoder.make_source()
        source.prefill(ids, torch.ones_like(ids))
        logprobs = source.begin_step(ids[:, -1], params)  # [1, V_target]
        assert logprobs.shape[-1] == output_width(decoder.target)
        assert torch.isinf(logprobs[0, n:]).all() and torch.isfinite(logprobs[0, :n]).any()


@pytest.mark.parametrize("pair", ["narrow-draft", "wide-draft"])
@pytest.mark.parametrize("method,options", [("chain", {"k": 4}), ("eagle2", {"depth": 3, "top_k": 3, "total_tokens": 8}), ("chain-tabed", {"k": 3})])
def test_greedy_equals_target_generate(width_pairs, pair, method, options):
    target_dir, draft_dir = width_pairs[pair]
    extra = {"draft_source": "tabed", "views": "M,tail4"} if method == "chain-tabed" else {}
    decoder = SpeculativeDecoder.from_pretrained(str(target_dir), str(draft_dir), method=method.split("-")[0], device="cpu", **extra, **options)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for prompt in ("def add(a, b):", "for i in range(10):"):
        ids = decoder.encode(prompt)
        ref = target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(ids) :].tolist()
        result = decoder.generate(prompt, max_new_tokens=16)
        assert result.token_ids == ref, (pair, method, prompt)
        assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("pair", ["narrow-draft", "wide-draft"])
@pytest.mark.parametrize("verify", ["sampling", "mars"])
def test_sampling_and_mars_run_with_unequal_widths(width_pairs, pair, verify):
    """The reported crash: temperature 0.8 raised 'size of tensor a (8320) must match ... (8192)'."""
    target_dir, draft_dir = width_pairs[pair]
    decoder = SpeculativeDecoder.from_pretrained(str(target_dir), str(draft_dir), method="static", verify=verify, device="cpu", depth=3, branching=2)
    width = output_width(decoder.target)
    for temperature in (0.0, 0.8):
        results = decoder.generate(["def add(a, b):", "class A:"], max_new_tokens=12, temperature=temperature, seed=1)
        for result in results:
            assert len(result.token_ids) == 12 and all(0 <= t < width for t in result.token_ids)


V = 6
PROMPT = [1, 4, 2, 5]
TOKENS = 3
N_SAMPLES = 3000


@pytest.mark.parametrize("draft_width", [8, 5])
@pytest.mark.parametrize(
    "method,options,walk",
    [("chain", {"k": 3}, "auto"), ("static", {"depth": 2, "branching": 2, "max_nodes": 6}, "host"), ("static", {"depth": 2, "branching": 2, "max_nodes": 6}, "device")],
)
def test_sampling_is_lossless_with_unequal_widths(draft_width, method, options, walk):
    """Chi-square p > 1e-3 against the enumerated target joint (fixed seeds: deterministic)."""
    target = tiny_model("llama", seed=3, vocab=V, eos=V - 1)
    draft = tiny_model("llama", seed=11, vocab=draft_width, layers=1, eos=2)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
        draft.get_output_embeddings().weight.mul_(3.0)
    boost_extra_rows(draft, V, scale=3.0)
    fit = VocabFit.for_pair(target, draft, V)
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine(target, make_policy(method, **options), SamplingRule(walk=walk), ModelDraftSource(draft, vocab=fit), eos_token_ids=[])
    counts = np.zeros((V,) * TOKENS)
    for i in range(N_SAMPLES // 500):
        for out in engine.generate([PROMPT] * 500, TOKENS, params, seed=2000 + i):
            counts[tuple(out.token_ids)] += 1
    pvalue = chi2_pvalue(counts, exact_joint(target, PROMPT, V, TOKENS, params))
    assert pvalue > 1e-3, f"draft width {draft_width}, {method} ({walk} walk): chi-square p = {pvalue:.2e}"
    outs = engine.generate([PROMPT] * 200, TOKENS, params, seed=5)
    accepted, drafted = sum(o.stats.accepted_tokens for o in outs), sum(o.stats.drafted_tokens for o in outs)
    assert 0 < accepted < drafted  # rejections happen, so the residual path is exercised
