import glob
import json
import os
from collections import Counter

rows = []
for p in sorted(glob.glob("runs/vlm-sweep/results/*.json")):
    t = os.path.basename(p)[:-5]
    try:
        with open(p) as fh:
            r = json.load(fh)
    except Exception:
        rows.append((t, "NO-RESULT", ""))
        continue
    c = r.get("class")
    if c == "NOT-BUILT":
        d = r["reason"].splitlines()[0][:160]
    elif c == "REFUSED":
        d = r["reason"][:150]
    else:
        parts = []
        for k, v in r.get("runs", {}).items():
            if "crash" in v:
                parts.append(f"{k}: CRASH {v['crash'][:110]} @ {v['frame']}")
            elif v.get("diffs"):
                parts.append(f"{k}: diff " + ",".join(f"p{d['prompt']}@{d['first_diff']}" for d in v["diffs"]))
        d = f"n_img={r.get('n_image_tokens')} d_logit={r.get('image_logit_delta')} img_changes_ref={r.get('image_changes_ref')}" + ("; " + "; ".join(parts) if parts else "")
    rows.append((t, c, d))
with open("runs/vlm-sweep/summary.md", "w") as f:
    f.write("| type | class | detail |\n|---|---|---|\n")
    for t, c, d in rows:
        f.write(f"| {t} | {c} | {d.replace('|', '/')} |\n")
print(Counter(c for t, c, _ in rows if not t.endswith(".forced")))
