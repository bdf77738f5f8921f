#!/bin/bash
# Re-run every README-cited report on the bundled pair (issue #17 step 5), one after another, from the repository root.
set -x
cd "$(dirname "$0")/.."
S=.venv/bin/specdec
# the model card's figures (perplexity, agreement, loops, latency; about 3 minutes)
$S train evaluate --loops --loop-tokens 96 --threads 2 --out benchmarks/bundled-pair/eval-v2.json
# the bundled pair's cost profile first: CAST in every report below reads it (about 2 minutes)
$S profile --batch-sizes 1,2,4,8,16 --out specdec/assets/pair/cost_profile.json
$S bench --prompts stdlib-heldout --methods ar,hf,hf-assisted,hf-lookup,chain,static,eagle2,dynatree,cast --max-new-tokens 128 --num-prompts 10 --repeats 3 --out benchmarks/methods-greedy --no-progress
$S bench --methods ar,hf,hf-assisted,chain,static,eagle2,dynatree,cast --max-new-tokens 96 --num-prompts 6 --repeats 3 --no-progress --out benchmarks/hotpath-cpu
M=ar,chain,static,static:tree_sampling=topk,eagle2,eagle2:tree_sampling=topk,eagle2:top_k=2,total_tokens=10,dynatree,dynatree:tree_sampling=topk,cast,cast:tree_sampling=topk,eagle2@mars:theta=0.9
$S bench --prompts stdlib-heldout --methods $M --max-new-tokens 96 --num-prompts 10 --repeats 1 --temperature 1   --seed 0 --out benchmarks/sampling-trees/t1 --no-progress
$S bench --prompts stdlib-heldout --methods $M --max-new-tokens 96 --num-prompts 10 --repeats 1 --temperature 0.7 --seed 0 --out benchmarks/sampling-trees/t0.7 --no-progress
$S bench --prompts stdlib-heldout --methods ar,chain,static,eagle2,dynatree,cast --batch-sizes 1,2,4,8,16 --max-new-tokens 96 --num-prompts 16 --repeats 2 --no-progress --out benchmarks/batch-sweep-cpu
$S bench --prompts stdlib-heldout --methods ar,chain,static,eagle2,dynatree,dynatree:calibrate=off,cast --max-new-tokens 96 --num-prompts 8 --repeats 3 --no-progress --out benchmarks/dynatree-calibrated
$S bench --prompts stdlib-heldout --methods ar,hf-lookup,chain:k=5,chain:k=10,dynatree --draft-source lookup --lookup-ngram 3 --max-new-tokens 128 --num-prompts 10 --repeats 2 --no-progress --out benchmarks/lookup
$S bench-serve --methods ar,chain --concurrency 1,2,4,8,16 --requests-per-client 8 --max-tokens 64 --out benchmarks/serving
$S bench --prompts stdlib-heldout --methods chain,eagle2 --mars-thetas 0.84,0.86,0.88,0.9,0.92,0.94,0.96,0.98 --max-new-tokens 128 --num-prompts 6 --repeats 2 --out benchmarks/mars-t0 --no-progress
$S bench --prompts stdlib-heldout --methods chain,eagle2 --mars-thetas 0.84,0.86,0.88,0.9,0.92,0.94,0.96,0.98 --max-new-tokens 128 --num-prompts 6 --repeats 2 --temperature 1 --seed 0 --out benchmarks/mars-t1 --no-progress
echo ALL DONE
