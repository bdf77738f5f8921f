#!/bin/bash
# usage: run_one.sh TYPE [stage]  -> appends to runs/vlm-sweep/results/TYPE.json
cd "$(dirname "$0")/../../.."
mkdir -p runs/vlm-sweep/results
ulimit -v 6000000
OMP_NUM_THREADS=1 timeout 300 .venv/bin/python benchmarks/architecture-sweep/images/sweep.py "$1" "${2:-all}" > runs/vlm-sweep/results/$1.out 2>&1
rc=$?
grep '^RESULT ' runs/vlm-sweep/results/$1.out | sed 's/^RESULT //' > runs/vlm-sweep/results/$1.json
python3 - "$1" "$rc" <<'PY'
import json,sys
t,rc=sys.argv[1],sys.argv[2]
try:
    r=json.load(open(f"runs/vlm-sweep/results/{t}.json"))
except Exception:
    print(t, "NO-RESULT rc="+rc); sys.exit()
line=[t, r.get("class"), "n_img=%s"%r.get("n_image_tokens"), (r.get("reason") or "")[:200]]
if "runs" in r:
    for k,v in r["runs"].items():
        line.append(k+":"+("ok" if v.get("ok") else "REF" if "refused" in v else ("CRASH "+v["crash"][:100]+" @"+str(v.get("frame"))) if "crash" in v else "diff"+str([(d["prompt"],d["first_diff"]) for d in v["diffs"]])))
if "images_read" in r: line.append("images_read=%s d_logit=%s changes_ref=%s"%(r["images_read"], r.get("image_logit_delta"), r.get("image_changes_ref")))
print(" | ".join(map(str,line)))
PY
