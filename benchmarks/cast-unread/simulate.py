import sys; sys.path.insert(0, "tests")
from test_tree_rules import mean_rate, run, DRAFTS, Simulation, gpu_like_table
for device in ("gpu", "cpu"):
    for draft in sorted(DRAFTS):
        for b in (1, 2, 4, 8, 16):
            r = mean_rate("cast", draft, device, b)
            u = mean_rate("cast", draft, device, b, reads_while_drafting=False)
            e = mean_rate("eagle2", draft, device, b)
            print(f"{device} {draft:15s} B={b:2d} cast read {r:.4f} unread {u:.4f} ({u/r:.3f}) eagle2 {e:.4f} unread/eagle2 {u/e:.3f}", flush=True)
