#!/bin/bash
# usage: run_forced.sh TYPE -> results/TYPE.forced.json (monkeypatches specdec's is_multimodal to True; probe only)
cd "$(dirname "$0")/../../.."
ulimit -v 6000000
OMP_NUM_THREADS=1 timeout 300 .venv/bin/python benchmarks/architecture-sweep/images/sweep.py "$1" --force-multimodal > runs/vlm-sweep/results/$1.forced.out 2>&1
grep '^RESULT ' runs/vlm-sweep/results/$1.forced.out | sed 's/^RESULT //' > runs/vlm-sweep/results/$1.forced.json
python3 -c "
import json;r=json.load(open('runs/vlm-sweep/results/$1.forced.json'))
print('$1 forced', r['class'], {k:('ok' if v.get('ok') else v.get('crash','')[:120] or v.get('refused','')[:120] or [(d['prompt'],d['first_diff']) for d in v['diffs']]) for k,v in r.get('runs',{}).items()})"
