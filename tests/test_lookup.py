"""Prompt lookup as a draft source: n-gram matching, greedy equivalence, and the CLI flag."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import EOS, sharpen, tiny_model

from specdec.cli import main
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.sampling import SamplingParams
from specdec.sources.lookup import LookupDraftSource, lookup_next
from specdec.verification import GreedyRule


def test_lookup_next_prefers_longest_latest_match():
    assert lookup_next([5, 6, 7, 9, 5, 6], 3, 1) == 7
    assert lookup_next([1, 2, 3, 1, 2, 4, 1, 2], 2, 1) == 4  # the latest [1, 2] is followed by 4
    assert lookup_next([1, 2, 3, 4], 3, 1) is None
    assert lookup_next([9, 9], 3, 1) == 9


@pytest.mark.parametrize("method,options", [("chain", {"k": 4}), ("static", {"depth": 3, "branching": 2, "max_nodes": 10}), ("dynatree", {}), ("dynatree", {"free_tokens": 16})])
def test_lookup_greedy_equals_generate_and_accepts(method, options):
    target = sharpen(tiny_model("llama", seed=0))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), LookupDraftSource(96), eos_token_ids=[EOS])
    outs = engine.generate(prompts, 40, batch_size=1)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(prompt) :]
        assert out.token_ids == ref.tolist()
    assert sum(o.stats.accepted_tokens for o in outs) > 0  # random models repeat themselves


def test_cli_lookup_needs_no_draft(capsys, tiny_pair_dir):
    code = main(["generate", "--target", str(tiny_pair_dir / "target"), "--draft-source", "lookup", "--method", "chain",
                 "--prompt", "for i in range(10):\n    print(i)\nfor i in range(10):\n", "--max-new-tokens", "10", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["token_ids"]
    code = main(["generate", "--target", str(tiny_pair_dir / "target"), "--draft-source", "ngram", "--prompt", "x"])
    assert code == 2 and "--draft-source 'ngram'" in capsys.readouterr().err


def test_cast_with_lookup_needs_given_costs(capsys, tiny_pair_dir):
    """CAST times a draft model's forwards; n-gram lookup has no draft model: a one-line error at
    start-up naming the fix (it failed at the first step, telling users of SpeculativeDecoder to
    use SpeculativeDecoder), and CAST runs with lookup when its costs are given."""
    code = main(["generate", "--target", str(tiny_pair_dir / "target"), "--draft-source", "lookup", "--method", "cast", "--prompt", "x", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "--draft-source lookup has none" in err and "--cost-profile" in err and "Traceback" not in err
    from specdec.api import SpeculativeDecoder
    from specdec.cost import CostTable

    target, tokenizer = tiny_model("llama", seed=0), SimpleNamespace(pad_token_id=0, eos_token_id=EOS)
    with pytest.raises(SpecDecError, match="has none"):
        SpeculativeDecoder(target, tokenizer, None, method="cast", draft_source="lookup")
    table = CostTable.synthetic(lambda b, c, n: 10.0 + 0.1 * n, lambda b, c, n: 0.01)
    decoder = SpeculativeDecoder(target, tokenizer, None, method="cast", draft_source="lookup", cost_table=table)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(prompt) :]
    assert decoder.generate_ids([prompt], 12, SamplingParams())[0].token_ids == ref.tolist()


def test_which_methods_and_sources_need_a_draft_model():
    """One typed table answers it (the API, the server's lanes and bench-serve all ask it);
    cost-aware policies are told apart by their protocol, not by probing attributes."""
    from specdec.api import DRAFT_SOURCES, SpeculativeDecoder, needs_draft_model
    from specdec.drafting.base import CostAwarePolicy
    from specdec.methods import POLICY_CLASSES, method_uses_draft

    assert DRAFT_SOURCES == ("model", "lookup", "tabed")
    assert [m for m in POLICY_CLASSES if not method_uses_draft(m)] == ["ar"]
    assert needs_draft_model("chain", "model") and needs_draft_model("cast", "tabed")
    assert not needs_draft_model("chain", "lookup") and not needs_draft_model("ar", "model")
    assert [m for m in POLICY_CLASSES if isinstance(make_policy(m), CostAwarePolicy)] == ["dynatree", "cast"]
    assert [m for m in POLICY_CLASSES if getattr(POLICY_CLASSES[m], "requires_cost_table", False)] == ["cast"]  # dynatree falls back without costs
    target, tokenizer = tiny_model("llama", seed=0), SimpleNamespace(pad_token_id=0, eos_token_id=EOS)
    lookup = SpeculativeDecoder(target, tokenizer, None, method="chain", draft_source="lookup")
    assert not lookup.lacks_draft_for("chain") and isinstance(lookup.make_source(), LookupDraftSource)
    plain = SpeculativeDecoder(target, tokenizer, None, method="ar")
    assert plain.lacks_draft_for("chain") and not plain.lacks_draft_for("ar")


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"vocab_size": "96"}, "lookup vocab_size='96' must be a positive integer"),
        ({"vocab_size": 96, "max_ngram": 2.5}, "lookup max_ngram=2.5 must be a positive integer"),  # a TypeError in range() at the first step
        ({"vocab_size": 96, "max_ngram": None}, "lookup max_ngram=None must be a positive integer"),
    ],
)
def test_lookup_options_are_checked(options, needle):
    with pytest.raises(SpecDecError) as err:
        LookupDraftSource(**options)
    assert needle in str(err.value)


def test_lookup_sized_for_another_vocabulary_is_named():
    """Its distributions must be as wide as the target's logits (the accept rules compare them id by id)."""
    target = tiny_model("llama", seed=0)
    with pytest.raises(SpecDecError, match=r"the lookup source's vocab_size=50, but the target's logits are 96 wide; build it with vocab_size=output_width\(target\)"):
        SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), LookupDraftSource(50), eos_token_ids=[EOS])
