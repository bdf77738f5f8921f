"""CAST deciding from its plan alone (`reads_while_drafting=False`) against reading its values while
drafting, in the tree simulator (no read costs anything there): expected accepted tokens per ms on the
GPU-like and CPU-like tables of tests/test_tree_rules.py, both synthetic drafts, B = 1-16, EAGLE-2 beside.

    python benchmarks/cast-unread/simulate.py   (from the repository root)
"""

import sys

sys.path.insert(0, "tests")

from test_tree_rules import DRAFTS, mean_rate  # noqa: E402

for device in ("gpu", "cpu"):
    for draft in sorted(DRAFTS):
        for b in (1, 2, 4, 8, 16):
            read = mean_rate("cast", draft, device, b)
            unread = mean_rate("cast", draft, device, b, reads_while_drafting=False)
            eagle2 = mean_rate("eagle2", draft, device, b)
            print(
                f"{device} {draft:15s} B={b:2d} cast read {read:.4f} unread {unread:.4f} ({unread / read:.3f}) "
                f"eagle2 {eagle2:.4f} unread/eagle2 {unread / eagle2:.3f}",
                flush=True,
            )
