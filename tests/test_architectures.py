"""Which architectures specdec runs: greedy equivalence on more transformers architectures than
`ARCHS`, and a clear error, before any weights load, for the ones whose draft trees it cannot
verify (recurrent state, ALiBi from the cache index, unbuilt attention masks)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import EOS, MORE_ARCHS, WIDE_ARCHS, decode_in_session, tiny_any_config
from transformers import AutoModelForCausalLM

from specdec.cost.table import CostTable
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.models.loading import check_causal_lm
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource
from specdec.verification import GreedyRule, make_rule

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]
METHODS = {"chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {"max_nodes": 12}}


def tiny(model_type: str, seed: int, noise: float = 0.0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_any_config(model_type, **overrides)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)  # peaked distributions: few near-ties
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model


@pytest.mark.parametrize("model_type", MORE_ARCHS)
def test_greedy_matches_generate_on_more_architectures(model_type):
    """A batch of three prompts of different lengths (left padding), 24 new tokens, a close draft."""
    target, draft = tiny(model_type, seed=0), tiny(model_type, seed=0, noise=0.02)
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in PROMPTS]
    accepted = 0
    for method, options in METHODS.items():
        engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
        outs = engine.generate(PROMPTS, 24)
        for prompt, out, ref in zip(PROMPTS, outs, refs, strict=True):
            assert out.token_ids == ref, f"{model_type}/{method}/{prompt}"
            accepted += out.stats.accepted_tokens
    assert accepted > 0, "the close draft should get some tokens accepted"


GPU_LIKE_TABLE = CostTable.synthetic(lambda b, c, n: 10.0 + 0.01 * b * n, lambda b, c, n: 1.0 + 0.01 * b * n)
"""flat in n (verification nearly free), so CAST's trees grow as on a GPU"""

STATIC_BUDGETS = [6, 20, 11, 16]
"""token budgets of `PROMPTS` + [[3, 4]] in the static-shape test: rows finish at different steps"""


@pytest.mark.parametrize(
    "model_type",
    [*MORE_ARCHS, *(pytest.param(m, marks=pytest.mark.skipif(not os.environ.get("SPECDEC_WIDE_ARCHS"), reason="opt-in: SPECDEC_WIDE_ARCHS=1")) for m in WIDE_ARCHS)],
)
def test_static_shapes_on_more_architectures(model_type):
    """The GPU's default forward path (static shapes, which CUDA graphs replay there) run on the
    CPU: a rolling batch of two rows over four prompts with different budgets, so finished rows
    ride along inactive while the other row decodes and waiting prompts take their place. Every
    tree method gives generate()'s greedy tokens, sliding windows, latent attention and shared
    key/value layers included."""
    prompts = [*PROMPTS, [3, 4]]
    target, draft = tiny(model_type, seed=0), tiny(model_type, seed=0, noise=0.02)
    with torch.no_grad():
        refs = [
            target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist()
            for p, n in zip(prompts, STATIC_BUDGETS, strict=True)
        ]
    methods = {**METHODS, "cast": {"cost_table": GPU_LIKE_TABLE}}
    for method, options in methods.items():
        engine = SpeculativeEngine(
            target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft, static_shapes=True), eos_token_ids=[EOS], static_shapes=True
        )
        outputs, sizes = decode_in_session(engine, prompts, STATIC_BUDGETS, max_rows=2)
        assert outputs == refs, f"{model_type}/{method}"
        assert set(sizes) == {2}, f"{model_type}/{method}: batch sizes {set(sizes)} (finished rows should ride along)"


CROSS_PAIRS = [("llama", "gpt2"), ("gpt2", "gemma2"), ("gemma2", "deepseek_v3"), ("deepseek_v3", "gpt_neox")]
"""(target, draft) of different architectures with one vocabulary: learned against rotary positions,
sliding windows against full attention, latent attention's compressed cache beside plain keys and values"""


@pytest.mark.parametrize(("target_type", "draft_type"), CROSS_PAIRS)
def test_a_draft_of_another_architecture(target_type, draft_type):
    """The draft runs its own cache layout beside the target's: every tree method, a rolling batch
    of two rows over four prompts, dynamic and static shapes, greedy and sampled, completes and
    gives the target's own greedy tokens. (An unrelated draft is rarely accepted, so this guards
    the two runners' bookkeeping side by side, not acceptance.)"""
    prompts = [*PROMPTS, [3, 4]]
    target, draft = tiny(target_type, seed=0), tiny(draft_type, seed=1)
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in prompts]
    methods = {**METHODS, "cast": {"cost_table": GPU_LIKE_TABLE}}
    for static_shapes in (False, True):
        for method, options in methods.items():
            engines = [
                SpeculativeEngine(
                    target, make_policy(method, **options), rule, ModelDraftSource(draft, static_shapes=static_shapes), eos_token_ids=[EOS], static_shapes=static_shapes
                )
                for rule in (GreedyRule(), make_rule("sampling"))
            ]
            outs = engines[0].generate(prompts, 16, batch_size=2)
            assert [o.token_ids for o in outs] == refs, f"{target_type} <- {draft_type}/{method}/static={static_shapes}"
            sampled = engines[1].generate(prompts, 16, params=SamplingParams(temperature=0.8, top_p=0.9), seed=1, batch_size=2)
            assert all(o.token_ids for o in sampled)


EVERY_METHOD = {
    "ar": {}, "chain": {"k": 4}, "static": {}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {},
    "dynatree-free": {"free_tokens": 16}, "cast": {},
}


@pytest.mark.skipif(not os.environ.get("SPECDEC_WIDE_ARCHS"), reason="the wide sweep takes ~6 minutes: set SPECDEC_WIDE_ARCHS=1")
@pytest.mark.parametrize("model_type", WIDE_ARCHS + MORE_ARCHS)
def test_every_method_on_every_architecture(model_type):
    """Every method, batch sizes 1 and 2 over four prompts (a rolling batch), gives generate()'s
    greedy tokens; a sampled run (T = 0.8, top-p 0.9) completes. CAST gets a GPU-like cost table
    so its trees grow."""
    prompts = [*PROMPTS, [3, 4]]
    target, draft = tiny(model_type, seed=0), tiny(model_type, seed=0, noise=0.02)
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in prompts]
    for label, options in EVERY_METHOD.items():
        method = label.split("-")[0]
        if method == "cast":
            options = {"cost_table": GPU_LIKE_TABLE}
        for batch_size in (1, 2):
            engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), ModelDraftSource(draft), eos_token_ids=[EOS])
            outs = engine.generate(prompts, 20, batch_size=batch_size)
            assert [o.token_ids for o in outs] == refs, f"{model_type}/{label}/B={batch_size}"
            engine = SpeculativeEngine(target, make_policy(method, **options), make_rule("sampling"), ModelDraftSource(draft), eos_token_ids=[EOS])
            outs = engine.generate(prompts, 20, params=SamplingParams(temperature=0.8, top_p=0.9), seed=1, batch_size=batch_size)
            assert all(o.token_ids for o in outs), f"{model_type}/{label}/B={batch_size} sampled"


UNSUPPORTED = {
    # (whichever check names them: a forward without a cache argument, as in transformers 5.23, or
    # the state layers of the cache it lays out, as for mamba in 5.24, which takes a `cache`)
    "mamba": ({}, "recurrent (or convolutional )?state"),
    "rwkv": ({}, "recurrent (or convolutional )?state"),
    "falcon_h1": ({}, "recurrent or convolutional state"),
    "minimax": ({}, "recurrent or convolutional state"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "recurrent or convolutional state"),
    "bloom": ({}, "ALiBi"),
    "mpt": ({}, "ALiBi"),
    "falcon": ({"alibi": True}, "ALiBi"),
    "llama4_text": ({}, "chunked_attention"),
    "deepseek_v32": ({}, "other than plain keys and values"),  # the sparse-attention indexer's keys
    "openai-gpt": ({}, "takes no key/value cache"),
    "cpmant": ({}, "takes no position ids"),  # positions from the sequence: its engine run crashed mid-prefill
    # local windows counted in cache slots: its tree runs gave other tokens than generate() (every real GPT-Neo has local layers)
    "gpt_neo": ({"num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": 6}, "last 6 slots of the cache"),
}


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED))
def test_unsupported_architecture_is_named_before_loading(model_type):
    overrides, reason = UNSUPPORTED[model_type]
    config = tiny_any_config(model_type, **overrides)
    with pytest.raises(SpecDecError, match=reason) as err:
        check_causal_lm(config, "some/model", "target")
    assert "'some/model'" in str(err.value) and "generate()" in str(err.value)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_gpt_neo_without_local_layers_decodes_exactly(static_shapes):
    """GPT-Neo is refused only for its local layers (`test_unsupported_architecture_is_named_before_loading`):
    with global layers alone its slot-indexed mask buffer is plain causal, which the tree mask refines."""
    overrides = {"num_layers": 2, "attention_types": [[["global"], 2]], "window_size": 6, "max_position_embeddings": 512}
    target, draft = tiny("gpt_neo", seed=0, **overrides), tiny("gpt_neo", seed=0, noise=0.02, **overrides)
    check_causal_lm(target.config, "some/model", "target")
    with torch.no_grad():
        refs = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in PROMPTS]
    for method, options in METHODS.items():
        source = ModelDraftSource(draft, static_shapes=static_shapes)
        engine = SpeculativeEngine(target, make_policy(method, **options), GreedyRule(), source, eos_token_ids=[EOS], static_shapes=static_shapes)
        assert [o.token_ids for o in engine.generate(PROMPTS, 24, batch_size=2)] == refs, method


@pytest.mark.parametrize("model_type", ["bloom", "mamba", "lfm2", "gpt_neo"])
def test_unsupported_loaded_model_is_refused_by_the_runner(model_type):
    """A model object handed to the engine directly (no loading path) gets the same error."""
    overrides, reason = UNSUPPORTED[model_type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_any_config(model_type, **overrides)).eval()
    with pytest.raises(SpecDecError, match=reason):
        ModelRunner(model)


def test_falcon_without_alibi_is_accepted():
    """The ALiBi rule reads the config: Falcon's default rotary positions pass."""
    assert check_causal_lm(tiny_any_config("falcon"), "falcon", "target") is AutoModelForCausalLM


def test_cache_argument_follows_the_forward_signature():
    """transformers 5.24 renamed a forward's `past_key_values` to `cache` (the old name still works
    there, with a deprecation warning): the runner passes the cache by the name the model takes."""
    from specdec.models.support import cache_argument, output_cache

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert (cache_argument(New()), cache_argument(Old()), cache_argument(object())) == ("cache", "past_key_values", "past_key_values")
    marker = object()
    assert output_cache(type("Out", (), {"cache": marker})()) is marker
    assert output_cache(type("Out", (), {"past_key_values": marker})()) is marker


def test_forward_without_logits_to_keep():
    """Older remote-code models take neither `logits_to_keep` nor `num_logits_to_keep` (and no
    **kwargs): the runner leaves the argument out and keeps the last positions itself. Before,
    every forward raised a TypeError. The old name is passed where it is the one taken."""
    from transformers import LlamaForCausalLM

    from specdec.models.support import cache_argument, logits_keep_argument

    base = tiny("llama", seed=0)
    base_cache = cache_argument(base)  # the name this transformers takes ('cache' from 5.24, 'past_key_values' before)

    class NoKeep(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None):  # type: ignore[override]
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **{base_cache: cache})

    class OldName(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, num_logits_to_keep=0):  # type: ignore[override]
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, logits_to_keep=num_logits_to_keep, **{base_cache: cache},
            )

    assert (logits_keep_argument(base), logits_keep_argument(NoKeep(base.config)), logits_keep_argument(OldName(base.config))) == ("logits_to_keep", None, "num_logits_to_keep")
    with torch.no_grad():
        refs = [base.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(p) :].tolist() for p in PROMPTS]
    for cls in (NoKeep, OldName):
        model = cls(base.config).eval()
        model.load_state_dict(base.state_dict())
        for method in ("ar", "eagle2"):
            engine = SpeculativeEngine(model, make_policy(method, **METHODS.get(method, {})), GreedyRule(), ModelDraftSource(model), eos_token_ids=[EOS])
            assert [o.token_ids for o in engine.generate(PROMPTS, 12)] == refs, (cls.__name__, method)
