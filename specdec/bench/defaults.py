"""The benchmarks' defaults and names, importable without torch (the CLI's help lists them)."""

from __future__ import annotations

BENCH_METHODS = "ar,hf,hf-assisted,hf-lookup,chain,static,eagle2"
"""the --methods default of `specdec bench`"""
PEERS: tuple[str, ...] = ("hf", "hf-assisted", "hf-lookup")
"""peer method names accepted in --methods"""

SCHEDULES: tuple[str, ...] = ("groups", "rolling")
"""how `specdec bench` feeds prompts to the batch (`BenchConfig.schedule`, `--schedule`)"""

SERVE_METHODS = "ar,chain"
"""the --methods default of `specdec bench-serve`"""
DEFAULT_CONCURRENCY = "1,2,4,8,16"
"""the --concurrency default of `specdec bench-serve`"""

DEFAULT_DEPTHS = "3,4,5,6,7,8"
DEFAULT_BRANCHINGS = "2,3,4"
DEFAULT_TAUS = "0.01,0.02,0.03,0.05,0.1"
"""the paper's grid (Appendix B): 6 x 3 x 5 = 90 configurations (`specdec sweep`)"""

ESTIMATE_AR_TOKENS_PER_S = 25.0
"""AR throughput assumed by the sweep's up-front time estimate (the bundled pair on a loaded 2-core CPU)"""


def estimate_tokens(configs: int, prompts: int, repeats: int, max_new_tokens: int) -> int:
    """Tokens the measurement generates at most: (configs + AR) x prompts x repeats x max_new_tokens."""
    return (configs + 1) * prompts * repeats * max_new_tokens


def estimate_text(configs: int, prompts: int, repeats: int, max_new_tokens: int, ar_tokens_per_s: float = ESTIMATE_AR_TOKENS_PER_S) -> str:
    """One line: the grid's size and a time estimate at AR speed (a tree at 1x AR)."""
    tokens = estimate_tokens(configs, prompts, repeats, max_new_tokens)
    minutes = tokens / ar_tokens_per_s / 60
    return (
        f"{configs} configs + AR x {prompts} prompt(s) x {repeats} repeat(s) x {max_new_tokens} tokens = up to {tokens} tokens: "
        f"about {minutes:.0f} min at {ar_tokens_per_s:g} tok/s (AR speed; faster configs take less), plus loading and warm-up"
    )
