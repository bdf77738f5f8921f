"""TABED ensemble drafting: greedy output equals the target's, sampling stays lossless,
and the weights adapt toward the view that matches the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import LVLM_TEXTS, SIZE_D, lvlm_image, tiny_model
from distribution import chi2_pvalue, exact_joint
from test_multimodal import reference

from specdec.api import SpeculativeDecoder, make_ensemble_config
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.multimodal.views import (
    CaptionView,
    ModelCaptioner,
    PassThroughView,
    PooledImageView,
    TextOnlyView,
    TruncatedView,
    parse_views,
    takes_encoder_outputs,
)
from specdec.sampling import SamplingParams, logits_to_logprobs
from specdec.sources.base import AcceptedPaths, TargetPath
from specdec.sources.ensemble import (
    EnsembleConfig,
    EnsembleDraftSource,
    EnsemblePrior,
    distances,
    estimated_speedup,
    grid_weights,
    mixture_logprobs,
)
from specdec.training.lvlm import make_processor
from specdec.verification import GreedyRule, SamplingRule


def _llava_takes_encoder_outputs() -> bool:
    from transformers.models.llava.modeling_llava import LlavaModel

    return takes_encoder_outputs(LlavaModel)


needs_pooled_view = pytest.mark.skipif(
    not _llava_takes_encoder_outputs(), reason="this transformers takes no precomputed image features (mm_encoder_outputs): the P view is refused"
)

POLICIES = {"chain": {"k": 4}, "eagle2": {"depth": 4, "top_k": 3, "total_tokens": 10}, "dynatree": {"free_tokens": 16}}  # dynatree: CUDA's free width


def test_target_path_logprobs_per_row_and_repeated():
    """`TargetPath.logprobs()` is, in one gather, each row's target log-distributions at the
    root and along its accepted path (the per-row loop the engine used to run for TABED);
    `AcceptedPaths.repeat_rows` maps row r*m + j to row r without copying the logits."""
    g = torch.Generator().manual_seed(0)
    b, n, v = 3, 6, 11
    logits = torch.randn(b, n, v, generator=g)
    paths = [[2, 4], [], [1, 3]]
    index = torch.tensor([[0, *p, *[0] * (2 - len(p))] for p in paths])
    params = SamplingParams(temperature=0.7, top_k=5)
    target = TargetPath(logits, torch.arange(b), index, params)
    got = target.logprobs()
    assert got.shape == (b, 3, v)
    for row, path in enumerate(paths):
        want = logits_to_logprobs(logits[row, torch.tensor([0, *path])], params)
        torch.testing.assert_close(got[row, : 1 + len(path)], want)
    accepted = AcceptedPaths(
        nodes=index[:, 1:], length=torch.tensor([2, 0, 2]), tokens=torch.zeros(b, n, dtype=torch.long),
        host_tokens=[[7] * len(p) for p in paths], host_active=[True, False, True], target=target,
    )
    rep = accepted.repeat_rows(2)
    assert rep.host_active == [True, True, False, False, True, True] and torch.equal(rep.nodes[4], index[2, 1:])
    assert rep.target.logits is logits
    torch.testing.assert_close(rep.target.logprobs(), got.repeat_interleave(2, dim=0))
    assert rep.length.tolist() == [2, 2, 0, 0, 2, 2]


def test_grid_weights():
    two = grid_weights(2, 10)
    assert two.shape == (11, 2) and torch.allclose(two.sum(1), torch.ones(11))
    assert two[0].tolist() == [0.5, 0.5]  # most even first
    assert {tuple(round(x, 1) for x in w) for w in two.tolist()} == {(round(1 - j / 10, 1), round(j / 10, 1)) for j in range(11)}
    assert grid_weights(4, 10).shape == (286, 4)  # compositions of 10 into 4 parts
    assert len({tuple(w) for w in grid_weights(3, 5).tolist()}) == 21 and torch.allclose(grid_weights(3, 5).sum(1), torch.ones(21))
    with pytest.raises(SpecDecError, match="12 views and grid_n=10 has 352716 weight candidates"):  # refused, not enumerated
        grid_weights(12, 10)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "1"), ("fixed_view", "0"), ("fixed_view", 1.0), ("support", 64.5), ("max_history", None), ("prior_decay", "0.9")],
)
def test_ensemble_config_rejects_wrong_types(field, value):
    from specdec.sources.ensemble import EnsembleConfig

    with pytest.raises(SpecDecError, match=field):
        EnsembleConfig(**{field: value}).validate(2)


def test_mixture_and_distances():
    q = torch.softmax(torch.randn(1, 2, 5), -1)  # [B=1, m=2, V]
    w = torch.tensor([[0.3, 0.7]])
    assert torch.allclose(mixture_logprobs(q.log(), w).exp(), 0.3 * q[:, 0] + 0.7 * q[:, 1], atol=1e-6)
    assert torch.allclose(mixture_logprobs(q.log(), torch.tensor([[1.0, 0.0]])).exp(), q[:, 0], atol=1e-6)
    p = torch.tensor([[0.5, 0.3, 0.2]])
    cand = torch.stack([p, torch.tensor([[0.2, 0.3, 0.5]])])  # [C=2, P=1, K]
    label = torch.tensor([0])
    kl = distances(p, cand, label, "kl")
    assert kl[0, 0].abs() < 1e-6 and kl[1, 0] > 0.1
    assert distances(p, cand, label, "tv")[:, 0].tolist() == pytest.approx([0.0, 0.3])
    assert distances(p, cand, label, "hard")[:, 0].tolist() == [0.0, 1.0]  # no draw given: argmax q
    # the paper's hard labels: a token sampled from each mixture (one shared uniform) against the label
    assert distances(p, cand, label, "hard", torch.tensor([0.3]))[:, 0].tolist() == [0.0, 1.0]
    assert distances(p, cand, label, "hard", torch.tensor([0.1]))[:, 0].tolist() == [0.0, 0.0]
    assert distances(p, cand, label, "hard", torch.tensor([0.7]))[:, 0].tolist() == [1.0, 1.0]
    short = torch.tensor([[[0.5, 0.2, 0.1]]])  # 0.2 of q's mass lies outside the support: a draw there mismatches
    assert distances(p, short, label, "hard", torch.tensor([0.9]))[:, 0].tolist() == [1.0]
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    rate = distances(p.expand(len(u), 3), cand.expand(2, len(u), 3), label.expand(len(u)), "hard", u).mean(-1)
    assert rate.tolist() == pytest.approx([0.5, 0.8], abs=0.02)  # 1 - q(label): the expected mismatch


def test_estimated_speedup():
    assert estimated_speedup(3.0, 5, 0.1) == pytest.approx(2.0)
    with pytest.raises(SpecDecError):
        estimated_speedup(3.0, -1, 0.1)


def _engine(lvlm, views, config=None, method="chain", draft=None):
    source = EnsembleDraftSource(lvlm["draft"] if draft is None else draft, views, config or EnsembleConfig())
    engine = SpeculativeEngine(lvlm["target"], make_policy(method, **POLICIES[method]), GreedyRule(), source, eos_token_ids=[lvlm["tok"].eos_token_id], pad_token_id=1)
    return engine, source


def _all_views(lvlm):
    draft, processor, tok = lvlm["draft"], make_processor(lvlm["tok"], SIZE_D), lvlm["tok"]
    views = [PassThroughView(), TextOnlyView(tok), CaptionView(tok, ModelCaptioner(draft, processor, max_new_tokens=6))]
    if takes_encoder_outputs(draft.model):  # (an older transformers takes no precomputed features: P is refused there)
        views.append(PooledImageView(draft, processor))
    return views


@pytest.mark.parametrize("method", list(POLICIES))
@pytest.mark.parametrize("policy", ["grid", "softmax", "random"])
def test_greedy_equals_target_with_every_view(lvlm, method, policy):
    """M, T, C, P views over a batch with one/two images and text only, all rows at once and rolling."""
    eos = lvlm["tok"].eos_token_id
    refs = [reference(lvlm["target"], p, 12, eos) for p in lvlm["prompts"]]
    views = _all_views(lvlm)
    for batch_size in (None, 2):
        engine, _ = _engine(lvlm, views, EnsembleConfig(policy=policy), method)
        outs = engine.generate(lvlm["prompts"], 12, batch_size=batch_size)
        assert [o.token_ids for o in outs] == refs, f"{method}/{policy}/batch={batch_size}"


def test_weights_move_to_the_view_that_matches_the_target(lvlm):
    """Draft = target: view M reproduces the target exactly, T does not. After the first
    verification, grid/KL picks w = [1, 0] on rows with images; on the text-only row both
    views are the same prompt, so every candidate ties and the most even one is kept.
    With M's weight 1 every drafted token is accepted."""
    views = [PassThroughView(), TextOnlyView(lvlm["tok"])]
    engine, source = _engine(lvlm, views, EnsembleConfig(policy="grid", distance="kl"), draft=lvlm["target"])
    outs = engine.generate(lvlm["prompts"][:3], 12)
    assert source.traces[0][0] == [0.5, 0.5]
    assert source.traces[0][-1] == [1.0, 0.0] and source.traces[1][-1] == [1.0, 0.0]
    assert source.traces[2][-1] == [0.5, 0.5]
    assert outs[0].stats.accepted_tokens > 0
    # fixed on M: the draft is the target, so nothing is ever rejected
    engine, _ = _engine(lvlm, views, EnsembleConfig(policy="fixed", fixed_view=0), draft=lvlm["target"])
    out = engine.generate(lvlm["prompts"][:1], 10)[0]
    assert out.stats.accepted_tokens == out.stats.drafted_tokens > 0


def test_prior_carries_evidence_to_the_next_prompt(lvlm):
    """With a shared EnsemblePrior, a new prompt's first block uses what earlier prompts
    showed (w = [1, 0]: M is exact); with prior=False it starts at equal weights."""
    views = [PassThroughView(), TextOnlyView(lvlm["tok"])]
    for use_prior, first in ((True, [1.0, 0.0]), (False, [0.5, 0.5])):
        prior = EnsemblePrior()
        for i, prompt in enumerate(lvlm["prompts"][:2]):
            source = EnsembleDraftSource(lvlm["target"], views, EnsembleConfig(policy="grid", prior=use_prior), prior)
            engine = SpeculativeEngine(lvlm["target"], make_policy("chain", k=3), GreedyRule(), source, eos_token_ids=[lvlm["tok"].eos_token_id], pad_token_id=1)
            engine.generate([prompt], 10)
            if i == 1:
                assert source.traces[0][0] == first, use_prior
    assert prior.observations == 0  # prior=False never updates it


@pytest.mark.parametrize(("distance", "least"), [("tv", 0.9), ("hard", 0.5)])
def test_other_distances_also_find_the_matching_view(lvlm, distance, least):
    """TV moves the weight to the exact view; hard labels only count argmax mismatches, so
    every weight whose mixture keeps the target's argmax ties and the most even such one
    wins: the exact view then gets at least half."""
    views = [TextOnlyView(lvlm["tok"]), PassThroughView()]
    engine, source = _engine(lvlm, views, EnsembleConfig(policy="grid", distance=distance, window=4), draft=lvlm["target"])
    engine.generate(lvlm["prompts"][:1], 12)
    assert source.traces[0][-1][1] >= least


def test_text_pair_views_greedy():
    """The ensemble is not tied to images: a full-context and a last-3-token view of a text draft."""
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=5, layers=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    expected = SpeculativeEngine(target, make_policy("ar"), GreedyRule(), None, eos_token_ids=[2]).generate(prompts, 16)
    source = EnsembleDraftSource(draft, [PassThroughView(), TruncatedView(3)], EnsembleConfig(policy="softmax"))
    outs = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), source, eos_token_ids=[2]).generate(prompts, 16)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert TruncatedView(3).encode([1, 2, 3, 4, 5]) == ([3, 4, 5], {})


def test_text_pair_views_in_a_session_ramping_up():
    """Prompts joining a running TABED batch one a step: the ensemble's draft runner holds m rows a
    prompt, so its storage grows with room for m x max_rows (`keep_source_rows`); greedy output is
    still the target's, and the draft's storage moves less often than once a join."""
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=5, layers=1)
    prompts = [[12, 13, 14], [15, 16, 17, 18], [19, 20, 21, 22, 23], [30, 31, 32]]  # (none ends early)
    expected = SpeculativeEngine(target, make_policy("ar"), GreedyRule(), None, eos_token_ids=[2]).generate(prompts, 16)
    source = EnsembleDraftSource(draft, [PassThroughView(), TruncatedView(3)], EnsembleConfig(policy="softmax"))
    engine = SpeculativeEngine(target, make_policy("chain", k=3), GreedyRule(), source, eos_token_ids=[2])
    session = engine.session(max_rows=4)
    requests, moves = [], 0
    for prompt in prompts:
        before = source.inner.runner.cache.storage if requests else None
        requests.append(session.submit(prompt, 16))
        session.step()
        moves += before is not None and source.inner.runner.cache.storage.data_ptr() != before.data_ptr()
        del before
    assert source.inner.runner.cache.rows == 2 * len(prompts)  # m = 2 views a prompt
    assert moves == 2  # at 2 and 3 prompts (room for 4 x 2 rows); the 4th joined in place
    while not session.idle:
        session.step()
    assert [r.token_ids for r in requests] == [o.token_ids for o in expected]


def test_sampling_with_the_ensemble_is_lossless():
    """Chi-square on the first three tokens (6-token vocabulary) against the exact target
    distribution, with the ensemble of a full and a truncated view as the proposal."""
    v, prompt, n = 6, [1, 4, 2, 5], 3000
    target = tiny_model("llama", seed=3, vocab=v, eos=-1 % v)
    draft = tiny_model("llama", seed=11, vocab=v, layers=1, eos=-1 % v)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
        draft.get_output_embeddings().weight.mul_(3.0)
    params = SamplingParams(temperature=1.0)
    counts = np.zeros((v,) * 3)
    for i in range(n // 500):
        source = EnsembleDraftSource(draft, [PassThroughView(), TruncatedView(2)], EnsembleConfig(policy="grid", grid_n=4))
        engine = SpeculativeEngine(target, make_policy("chain", k=2), SamplingRule(), source, eos_token_ids=[])
        for o in engine.generate([prompt] * 500, 3, params, seed=100 + i):
            counts[tuple(o.token_ids)] += 1
    pvalue = chi2_pvalue(counts, exact_joint(target, prompt, v, 3, params))
    assert pvalue > 1e-3, pvalue


@needs_pooled_view
def test_api_and_errors(lvlm, tiny_pair_dir):
    root = lvlm["root"]
    dec = SpeculativeDecoder.from_pretrained(str(root / "target"), str(root / "draft"), method="chain", device="cpu", k=3, draft_source="tabed", views="M,T,P")
    eos = lvlm["tok"].eos_token_id
    result = dec.generate(LVLM_TEXTS[0], max_new_tokens=8, images=[lvlm_image(0)])
    assert result.token_ids == reference(lvlm["target"], lvlm["prompts"][0], 8, eos)
    assert [v.name for v in dec.ensemble_views()] == ["M", "T", "P"]
    with pytest.raises(SpecDecError, match="view X is not known|'X' is not known"):
        parse_views("M,X")
    with pytest.raises(SpecDecError, match="twice"):
        parse_views("M,M")
    with pytest.raises(SpecDecError, match="not known"):
        make_ensemble_config({"polcy": "grid"}, 2)
    with pytest.raises(SpecDecError, match="weight policy"):
        make_ensemble_config({"policy": "best"}, 2)
    with pytest.raises(SpecDecError, match="needs a vision-language pair"):
        SpeculativeDecoder.from_pretrained(str(tiny_pair_dir / "target"), str(tiny_pair_dir / "draft"), device="cpu", draft_source="tabed", views="M,C").make_source()


@needs_pooled_view
def test_bench_tabed_small(lvlm, tmp_path):
    """The benchmark matrix on the tiny pair: every greedy output equals AR's, Eq. (1) is
    applied with the measured cost ratio, and the report and plots are written."""
    from specdec.bench.tabed import run_tabed_bench

    root = lvlm["root"]
    dec = SpeculativeDecoder.from_pretrained(str(root / "target"), str(root / "draft"), method="chain", device="cpu")
    results = run_tabed_bench(dec, tmp_path, ["scenes-first-turn", "scenes-ood"], gammas=(2,), widths=(2,), num_prompts=2, max_new_tokens=5, ablation_gamma=2, log=lambda _: None)
    cells = results["cells"]
    assert {c["config"] for c in cells} >= {"M", "T", "C", "P", "TABED-MT", "TABED-MTCP", "Static-MT", "Random-MT", "TABED-MT h=1"}
    assert all(c["matches_ar"] for c in cells)
    for c in cells:
        assert c["tau"] >= 1.0
        assert c["estimated_speedup"] == pytest.approx(estimated_speedup(c["tau"], 2, c["cost_ratio"]))
    assert (tmp_path / "report.md").read_text().count("| TABED-MT |") >= 2
    assert (tmp_path / "tau_by_scenario.png").stat().st_size > 0
    assert (tmp_path / "weights_over_steps.png").stat().st_size > 0


def test_bench_tabed_names_a_prompt_past_the_context_before_any_run(lvlm, tmp_path):
    """--max-new-tokens past a model's context is named (the scenario, the prompt, the most that
    fits) before the first run starts (it was named by the first run's engine, after loading, and
    for a later scenario only after the earlier scenarios' runs)."""
    from specdec.bench.tabed import run_tabed_bench

    root = lvlm["root"]
    dec = SpeculativeDecoder.from_pretrained(str(root / "target"), str(root / "draft"), method="chain", device="cpu")
    lines: list[str] = []
    with pytest.raises(SpecDecError, match=r"scenes-first-turn prompt 0 \(\d+ tokens\) \+ max_new_tokens=\d+ exceeds .* context of \d+ tokens; lower max_new_tokens to at most \d+"):
        run_tabed_bench(dec, tmp_path, ["scenes-first-turn", "scenes-ood"], gammas=(2,), widths=(2,), num_prompts=1, max_new_tokens=dec.max_context - 20, log=lines.append)
    assert lines == []


def test_bench_tabed_needs_a_scenario(capsys):
    from specdec.cli import main

    assert main(["bench-tabed", "--scenarios", ",", "--out", "unused"]) == 2
    assert "names no scenario" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gammas", "100000"], "--gammas 100000 (a chain of 100000 draft tokens"),
        (["--widths", "100000"], "--widths 100000 (trees of depth 5"),
        (["--target", "some/target"], "needs --draft too"),
    ],
)
def test_bench_tabed_bad_shapes_and_pair_before_loading(tmp_path, capsys, monkeypatch, args, needle):
    from specdec.cli import main

    monkeypatch.setattr(SpeculativeDecoder, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded before the bad value was reported"))
    assert main(["bench-tabed", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "--k" not in err and "--expand-top-k" not in err and "--method" not in err
