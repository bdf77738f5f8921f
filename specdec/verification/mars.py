"""MARS: margin-aware verification (accept the target's runner-up when it barely trails).

At every verified node the target's **raw** logits z (before temperature, top-k, top-p)
give the top-2 tokens v1 = argmax z and v2 = the best other token, and the logit ratio
r = z(v2) / z(v1). The node is **low-margin** when z(v1) > 0 and r > theta; there the
target is treated as indifferent between v1 and v2.

Greedy (temperature 0), per node, siblings in this order of preference:

1. a child equal to v1 is accepted (the strict rule's own choice);
2. otherwise, at a low-margin node, a child equal to v2 is accepted (**relaxed**);
3. otherwise the path ends here and the bonus (correction) token is v1.

A leaf's bonus token is v1 there, as in strict greedy verification.

Sampling (temperature > 0), per node:

- at a low-margin node with a child equal to v1 or v2, that child is accepted outright
  (v1 preferred over v2, whatever the tree order), without an exact test;
- everywhere else the exact tests of lossless rejection sampling run over the children in
  tree order (`rejection_walk`), and if all are rejected the bonus token is drawn from the
  residual left by those tests; when the path ends at a leaf it is drawn from the target's
  own (temperature/top-k/top-p processed) distribution at that leaf.

So the only departure from the lossless rule is that, at low-margin nodes, a drafted v1 or
v2 is committed without a test. Where the relaxation does not fire (or theta >= 1) every
committed token is distributed exactly as the target's. Where it fires and no v1/v2 child
exists, the exact tests and residual make the tokens outside {v1, v2} exactly as likely as
the strict rule makes them; where a v1/v2 child exists, tokens outside {v1, v2} can only
lose probability to v1 and v2, never gain it (docs/mars.md has the argument).

Decisions use raw logits on purpose: temperature cancels in (z2/T)/(z1/T), but top-k/top-p
masks would turn z(v2) into -inf, and log-probabilities are shifted logits whose ratio means
nothing (log-softmax makes every value negative). Temperature and masks
still shape every exact test and every sampled bonus token; the relaxation itself is the
same at every temperature and mask (it may accept a v2 that top-k/top-p would exclude,
exactly as it does at temperature 0; it never accepts anything outside the top 2).

z(v1) <= 0 makes the ratio meaningless (for negative logits z(v2)/z(v1) >= 1), so such a
node is verified strictly and counted in `Verdict.strict_fallbacks` (once per verified
node on the walk, i.e. per node with children where the rule had to decide).
theta >= 1 can never fire (r <= 1 whenever z(v1) > 0): the rule then is exactly the strict
rule, consumes the same random numbers, and counts no fallbacks.

`Verdict.relaxed` counts accepted tokens the strict rule would not have accepted: greedy,
each accepted v2; sampling, each outright accept for which one draw of the exact tests at
that node (taken only for this count) would not have accepted the same child.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec import constants
from specdec.errors import SpecDecError
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification.base import Verdict, deepest_path
from specdec.verification.sampling import EXACT_TREE, HostBatch, RelaxHook, SamplingRule, check_walk, verdict_of, walks_on_device

if TYPE_CHECKING:
    from specdec.verification.captured import CapturedWalks

DEFAULT_THETA = 0.9
"""the paper's default logit-ratio threshold"""


def validate_theta(theta: object) -> float:
    """theta as a float; a SpecDecError naming the value and the fix unless it is a number > 0."""
    value = float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else float("nan")
    if not value > 0:  # also catches NaN and non-numbers
        raise SpecDecError(
            f"MARS theta={theta!r} must be a number > 0: the logit-ratio threshold, e.g. --mars-theta 0.9 "
            "(mars_theta=0.9, the paper's default); a value >= 1 disables the relaxation"
        )
    return value


@dataclass
class Margins:
    """Per-node top-2 statistics of the raw target logits. All tensors are [B, N]."""

    v1: torch.Tensor
    """int64 argmax of the raw logits (ties: the lowest id, as torch.argmax)"""
    v2: torch.Tensor
    """int64 the best token other than v1"""
    fire: torch.Tensor
    """bool: low-margin node, the relaxation applies (z1 > 0 and z2 / z1 > theta, theta < 1)"""
    fallback: torch.Tensor
    """bool: z1 <= 0, the ratio is undefined and the node is verified strictly (only counted when theta < 1)"""


def margins(raw_logits: torch.Tensor, theta: float) -> Margins:
    """Top-2 tokens, their logit ratio test and the z1 <= 0 fallback. raw_logits: [B, N, V]."""
    z = raw_logits.float()
    v1 = z.argmax(dim=-1)  # [B, N]
    z1 = z.gather(-1, v1[..., None])  # [B, N, 1]
    v2 = z.scatter(-1, v1[..., None], float("-inf")).argmax(dim=-1)  # [B, N]
    z2 = z.gather(-1, v2[..., None])
    z1, z2 = z1.squeeze(-1).double(), z2.squeeze(-1).double()  # [B, N]; float64 so r > theta is not rounded
    enabled = theta < 1 and z.shape[-1] >= 2
    positive = z1 > 0
    ratio = z2 / torch.where(positive, z1, torch.ones_like(z1))
    fire = positive & (ratio > theta) & enabled
    fallback = ~positive & enabled
    return Margins(v1=v1, v2=v2, fire=fire, fallback=fallback)


def outright_children(tree: TokenTree, m: Margins) -> torch.Tensor:
    """[B, N] int64: at each low-margin node, its child equal to v1, else its child equal to v2
    (accepted outright at T > 0); n (no node) elsewhere. Tensor ops, no host read; the same
    choice as `_relax_hook`'s."""
    b, n = tree.tokens.shape
    dev = tree.tokens.device
    parent = tree.parents.clamp(min=0)  # [B, N]
    child = tree.valid & (tree.parents >= 0)  # [B, N]
    cols = constants.arange(n, dev).expand(b, n)
    missing = torch.full((b, n), -1, dtype=torch.long, device=dev)
    picks = []
    for top in (m.v1, m.v2):  # per node: its child whose token is `top` there (the last one, as the hook's dict), -1 if none
        match = child & (tree.tokens == top.gather(1, parent))  # [B, N] per child
        slot = torch.where(match, parent, n)  # the dump column n for the rest
        picks.append(torch.full((b, n + 1), -1, dtype=torch.long, device=dev).scatter_reduce_(1, slot, torch.where(match, cols, missing), "amax")[:, :n])
    first, second = picks
    pick = torch.where(first >= 0, first, second)
    return torch.where(m.fire & (pick >= 0), pick, n)


def _relax_hook(tokens: list[int], v1: list[int], v2: list[int], fire: list[bool], fallback: list[bool]) -> RelaxHook:
    """The relaxation for one row (lists are per node): at a low-margin node, the child equal
    to v1, else the child equal to v2, is accepted outright; elsewhere nothing is, and a
    node with z1 <= 0 reports its strict fallback."""

    def relax(node: int, kids: list[int]) -> tuple[int | None, bool]:
        if not fire[node]:
            return None, fallback[node]
        by_token = {tokens[k]: k for k in kids}
        for tok in (v1[node], v2[node]):  # v1 first, then the relaxed v2
            if tok in by_token:
                return by_token[tok], False
        return None, False

    return relax


class MarsRule:
    """Margin-aware verification (see the module docstring): greedy at temperature 0,
    rejection sampling with the relaxation above it."""

    name = "mars"

    def __init__(self, theta: float = DEFAULT_THETA, walk: str = "auto") -> None:
        self.theta = validate_theta(theta)
        self.walk = check_walk(walk, "mars")
        self._lossless = SamplingRule(walk=self.walk)

    def prepare(self, tree: TokenTree, params: SamplingParams, walks: CapturedWalks | None = None) -> None:
        """Before the verify forward: with the target's captured walks (CUDA graphs) and T > 0 on
        the device, the tree is copied to the walks' buffers, so `verify` tests it as one graph
        replay (`CapturedWalks.relaxed`); without relaxation (theta >= 1), the lossless rule's own."""
        if params.greedy or walks is None:
            return
        if self.theta >= 1:
            self._lossless.prepare(tree, params, walks)
        elif walks_on_device(self.walk, tree.tokens.device):
            tree.verify_plan = walks.plan(tree, wavefront=False)

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        if not params.greedy and self.theta >= 1:  # no relaxation: exactly the lossless rule (and its tensor-only chain path)
            return self._lossless.verify(tree, target_logits, params, generator)
        plan = tree.verify_plan
        if not params.greedy and getattr(plan, "captured", False):  # prepared for a graph replay (`prepare`)
            return plan.walks.relaxed(EXACT_TREE, plan, target_logits, params, generator, self.theta)
        m = margins(target_logits, self.theta)
        if params.greedy:
            return self._verify_greedy(tree, m)
        return self._verify_sampling(tree, target_logits, m, params, generator)

    def _verify_greedy(self, tree: TokenTree, m: Margins) -> Verdict:
        """Vectorised: each node is 'ok' when it is the child the rule would pick at its parent.

        At most one child per node is ok (v1 if drafted, else a relaxed v2), so the accepted
        path is the unique deepest node whose ancestors are all ok, as in `greedy_accept`.
        """
        b, n = tree.tokens.shape
        par = tree.parents.clamp(min=0)  # [B, N]
        non_root = tree.valid & (tree.parents >= 0)
        strict = non_root & (tree.tokens == m.v1.gather(1, par))  # [B, N] the token is v1 at its parent
        zeros = torch.zeros(b, n, dtype=torch.long, device=tree.tokens.device)
        v1_child = zeros.scatter_add(1, par, strict.long()) > 0  # [B, N] node has a child equal to its v1
        has_child = zeros.scatter_add(1, par, non_root.long()) > 0  # [B, N] node has any child
        relaxed = non_root & m.fire.gather(1, par) & (tree.tokens == m.v2.gather(1, par)) & ~v1_child.gather(1, par)
        ok = strict | relaxed | (tree.parents < 0)  # the root is committed already
        deepest, on_path, path, accepted_len = deepest_path(tree, ok)
        bonus = m.v1.gather(1, deepest[:, None]).squeeze(1)
        return Verdict(
            path=path,
            accepted_len=accepted_len,
            bonus_tokens=bonus,
            relaxed_count=(relaxed & on_path).sum(dim=1),
            fallback_count=(m.fallback & has_child & on_path).sum(dim=1),
        )

    def _verify_sampling(
        self, tree: TokenTree, target_logits: torch.Tensor, m: Margins, params: SamplingParams, generator: torch.Generator | None
    ) -> Verdict:
        if walks_on_device(self.walk, target_logits.device):  # the same tests on the device, the relaxed picks given to them
            return EXACT_TREE.verify(tree, target_logits, params, generator, outright=outright_children(tree, m), fallback=m.fallback)
        host = HostBatch.read(tree, target_logits, params, generator)
        v1, v2, fire, fallback = (t.tolist() for t in (m.v1, m.v2, m.fire, m.fallback))  # [B][N] each, one transfer
        walks = [
            host.walk(row, _relax_hook(host.rows[row].tokens, v1[row], v2[row], fire[row], fallback[row])) for row in range(tree.batch_size)
        ]
        return verdict_of(walks, target_logits.device)
