#!/usr/bin/env bash
# One device-tool call per stage, each well inside the 10-minute limit of one command:
#
#   bash benchmarks/gpu/run.sh next    # second call of a 15-minute lease, at once after tests (which builds the pair): CAST and DynaTree levels on / off, the issue-18 bench
#   bash benchmarks/gpu/run.sh tests   # the test suite on the GPU machine (CUDA tests included), then bundled-t1
#   bash benchmarks/gpu/run.sh bundled-t1  # the bundled pair at T = 1, B = 1: issue 19's bar (eagle2, dynatree against the chain) on a GPU
#   bash benchmarks/gpu/run.sh b1      # synthetic 3B pair; every method and the HF peers at B = 1
#   bash benchmarks/gpu/run.sh sweep   # the same pair; ar, hf (batched generate), chain, static, eagle2, dynatree (measured / 64-token free width), cast (break-even / paper rules) at B = 1-16
#   bash benchmarks/gpu/run.sh ab      # the same bench with this tree and with an older package copy (OLD_PKG), in one call
#   bash benchmarks/gpu/run.sh host    # where the host's time goes per step, by function (pyinstrument; carry its wheel)
#   bash benchmarks/gpu/run.sh trace   # per-step draft forwards, nodes, times; CAST's predictions beside them
#   bash benchmarks/gpu/run.sh levels  # captured drafting levels: their CUDA tests, then on / off alternating (levels_ab.py)
#   bash benchmarks/gpu/run.sh levels-t1  # its T = 1 half alone (LEVELS_T1=0 levels ... leaves it for this second call)
#   bash benchmarks/gpu/run.sh sampling  # the same pair at T = 1, B = 1: the trees' sampled rules against the chain (#19),
#                                        # traversal on the device (the default) against child by child
#   bash benchmarks/gpu/run.sh unmeasured     # what earlier leases left unmeasured (greedy, B = 1, 2, 8): CAST unread / read, DynaTree's width
#   bash benchmarks/gpu/run.sh unmeasured-t1  # the same at T = 1 (B = 1, 8): DynaTree's free_sampled_children, CAST unread / read
#   bash benchmarks/gpu/run.sh depth-t1       # T = 1, B = 1: DynaTree's free-width depth (history rule, D_0 held at 5, D_0 from 8)
#   bash benchmarks/gpu/run.sh compile        # torch.compile of the target's forward against CUDA graphs (split KV storage)
#   (sweep, unmeasured, unmeasured-t1: SCHEDULE=rolling runs every prompt through one rolling batch, as a server batches)
#
# Writes under $OUT (the device tool brings back at most 8 files, 2 folders deep): a log per stage
# and the bench folders as one .tar.gz each. The GPU image has torch, transformers, rich, numpy,
# scipy, matplotlib and pytest but not fastapi/pydantic, so the serving tests are left out there.
# Locally (no GPU) `SHAPE=tiny-llama DEVICE=cpu OUT=/tmp/gpu bash benchmarks/gpu/run.sh b1` checks
# the commands run; figures from it mean nothing.
set -uo pipefail
stage=${1:?usage: run.sh next|tests|bundled-t1|smoke|b1|sweep|sampling|profile|host|trace|ab|levels|levels-t1|unmeasured|unmeasured-t1|depth-t1|compile|pair|costs}
OUT=${OUT:?set OUT to the folder for results}
SHAPE=${SHAPE:-llama-3.2-3b}
DEVICE=${DEVICE:-cuda}
AGREEMENT=${AGREEMENT:-0.8}
PAIR=${PAIR:-/tmp/specdec-pair}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 SPECDEC_CACHE_DIR=${SPECDEC_CACHE_DIR:-/tmp/specdec-cache}
PY=${PY:-python3}
mkdir -p "$OUT"

if ! command -v specdec >/dev/null 2>&1; then  # offline, no dependencies: the image has them
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
fi
{ nvidia-smi 2>/dev/null || true; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'); print('transformers', transformers.__version__)"; } | tee "$OUT/machine.txt"

pair() {  # the synthetic pair, built once per machine (a fresh machine starts bare)
  [ -f "$PAIR/synth_pair.json" ] && return 0
  local t0=$SECONDS
  specdec synth-pair --shape "$SHAPE" --agreement "$AGREEMENT" --device "$DEVICE" --out "$PAIR" >"$OUT/pair.log" 2>&1 || { tail -20 "$OUT/pair.log"; exit 1; }
  echo "synthetic $SHAPE pair built in $((SECONDS - t0)) s"; tail -3 "$OUT/pair.log"
}

per_batch_size() {  # SCRIPT NAME METHODS B: benchmarks/gpu/SCRIPT on the pair at B = 1 and B (12 prompts a row, at most 48),
                   # the log appended to NAME.log, the outputs tarred as NAME.tar.gz
  local script=$1 name=$2 methods=$3 b
  for b in 1 $4; do
    $PY "benchmarks/gpu/$script" --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "$methods" --batch-size "$b" --num-prompts $((12 * b > 48 ? 48 : 12 * b)) --out "$OUT/$name/b$b" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/$name.log"
  done
  tar -czf "$OUT/$name.tar.gz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
}

levels_t1() {  # captured levels on / off at T = 1, B = 1 (levels_ab.py, seeded)
  $PY benchmarks/gpu/levels_ab.py --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
    --methods "${LEVELS_T1_METHODS:-chain,eagle2,static,dynatree,cast}" --temperature 1 --out "$OUT/levels-t1" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/levels.log"
  tar -czf "$OUT/levels-t1.tar.gz" -C "$OUT" levels-t1 && rm -rf "${OUT:?}/levels-t1"
}

bundled_t1() {  # the bundled pair (no synthetic pair needed) at T = 1, B = 1: issue 19's methods and the chain, with AR and HF beside them
  timeout "${BUNDLED_T1_S:-150}" specdec bench --prompts stdlib-heldout --device "$DEVICE" --methods "${BUNDLED_T1_METHODS:-ar,hf,chain,eagle2,dynatree,cast}" \
    --temperature 1 --seed 0 --num-prompts 16 --max-new-tokens 96 --repeats 1 --no-progress --out "$OUT/bundled-t1" 2>&1 | grep -v "Loading weights" | tee "$OUT/bundled-t1.log"
  tar -czf "$OUT/bundled-t1.tar.gz" -C "$OUT" bundled-t1 && rm -rf "${OUT:?}/bundled-t1"
}

case "$stage" in
  next)  # one call of about 9 minutes for a lease of 15 minutes of device time (machine start included), the work
         # that decides defaults first: the pair (about 2 minutes); captured levels on / off for CAST and DynaTree,
         # greedy, B = 1 (their levels sit at fixed places since 2026-12-01, so a layer's key no longer follows the
         # widths before it: is CAST's capture still the 16% loss of 2026-11-26?); captured verification walks on /
         # off at T = 1, B = 1, with the chain beside them (issue 19: does EAGLE-2 at T = 1 now pass the chain's
         # tok/s?); then issue 18's bench at B = 1 and 8 with the HF peers. Each part under a timeout, so a slow one
         # leaves the next its time; what finished comes back (next.log, next.tar.gz)
    pair
    timeout "${NEXT_LEVELS_S:-110}" $PY benchmarks/gpu/levels_ab.py --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" \
      --device "$DEVICE" --methods "${NEXT_LEVELS_METHODS:-cast,dynatree}" --batch-size 1 --num-prompts 8 --rounds 2 \
      --out "$OUT/next/levels-b1" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/next.log"
    timeout "${NEXT_WALKS_S:-100}" $PY benchmarks/gpu/levels_ab.py --switch walks --temperature 1 --target "$PAIR/target" --draft "$PAIR/draft" \
      --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" --methods "${NEXT_WALKS_METHODS:-chain,eagle2,dynatree}" --batch-size 1 --num-prompts 8 \
      --rounds 2 --out "$OUT/next/walks-t1-b1" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/next.log"
    timeout "${NEXT_BENCH_S:-180}" specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${NEXT_METHODS:-ar,hf,hf-assisted,chain,eagle2,dynatree,cast}" --batch-sizes "${BATCH_SIZES:-1,8}" --num-prompts 16 \
      --max-new-tokens 64 --repeats 1 --no-progress --out "$OUT/next/bench" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/next.log"
    tar -czf "$OUT/next.tar.gz" -C "$OUT" next && rm -rf "${OUT:?}/next"
    ;;
  walks)  # captured verification walks (SPECDEC_CAPTURE_WALKS) on / off at T = 1, B = 1 and 8, with the chain beside them
    pair
    for b in 1 8; do
      timeout "${WALKS_S:-200}" $PY benchmarks/gpu/levels_ab.py --switch walks --temperature 1 --target "$PAIR/target" --draft "$PAIR/draft" \
        --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" --methods "${WALKS_METHODS:-chain,eagle2,dynatree,static}" --batch-size "$b" \
        --num-prompts $((b == 1 ? 8 : 32)) --rounds 3 --out "$OUT/walks/t1-b$b" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/walks.log"
    done
    tar -czf "$OUT/walks.tar.gz" -C "$OUT" walks && rm -rf "${OUT:?}/walks"
    ;;
  tests)
    # the synthetic pair is built beside the tests (the GPU is idle during most of them), so a
    # bench stage in the same call finds it; pytest-xdist (in the image) spreads the tests over
    # WORKERS processes of 2 threads each
    ( pair ) > "$OUT/pair-bg.log" 2>&1 &
    ignore=(--ignore=tests/test_serve.py --ignore=tests/test_serve_text.py --ignore=tests/test_light_imports.py)
    # the bundled vision-language pair's weights (19 MB) stay behind when the working tree must fit
    # the device tool's 64 MiB
    [ -f specdec/assets/lvlm/target/model.safetensors ] || ignore+=(--ignore=tests/test_bundled_lvlm.py)
    # docs/ stays behind too (fit-tree.sh), and tests/test_docs.py reads it
    [ -d docs ] || ignore+=(--ignore=tests/test_docs.py)
    xdist=()
    # --dist load: by test, not by file (by file, test_graph_replay_semantics.py alone held one worker
    # past 300 s on an H100 machine, 2026-11-26; by test the whole suite took 89 s on 15 workers)
    # (without pytest-xdist the project's `addopts = "-q -n 2"` would not parse: plain addopts then)
    $PY -c "import xdist" 2>/dev/null && xdist=(-n "${WORKERS:-15}" --dist load) || xdist=(-o addopts=-q)
    OMP_NUM_THREADS=1 timeout "${TESTS_LIMIT_S:-420}" $PY -m pytest -q --maxfail=30 -p no:cacheprovider "${xdist[@]}" tests "${ignore[@]}" -rs --durations=15 2>&1 | tee "$OUT/tests.log"
    wait
    cat "$OUT/pair-bg.log"
    # issue 19's bar on its own terms: the bundled pair at T = 1 (eagle2 and dynatree against the K = 5 chain's
    # τ and tokens/s), on the GPU, where verifying 32 tokens costs about one token's (BUNDLED_T1_S=0 skips it)
    [ "${BUNDLED_T1_S:-150}" -gt 0 ] && bundled_t1
    ;;
  bundled-t1)  # the same on its own
    bundled_t1
    ;;
  smoke)  # a few prompts of the main methods on the pair: does every path run at this size, and what it costs
    pair
    timeout "${SMOKE_LIMIT_S:-240}" specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods ar,hf,hf-assisted,chain,eagle2,dynatree,cast --num-prompts 4 --max-new-tokens 48 --repeats 1 \
      --no-progress --out "$OUT/smoke" 2>&1 | tee "$OUT/smoke.log"
    tar -czf "$OUT/smoke.tar.gz" -C "$OUT" smoke && rm -rf "$OUT/smoke"
    ;;
  b1)
    pair
    specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods ar,hf,hf-assisted,chain,static,eagle2,dynatree,dynatree:free_tokens=64,dynatree:free_tokens=0,cast --num-prompts 12 --max-new-tokens 64 --repeats 1 \
      --no-progress --out "$OUT/b1" 2>&1 | tee "$OUT/b1.log"
    tar -czf "$OUT/b1.tar.gz" -C "$OUT" b1 && rm -rf "$OUT/b1"
    ;;
  sweep)
    pair
    specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${SWEEP_METHODS:-ar,hf,chain,static,eagle2,dynatree,dynatree:free_tokens=64,cast,cast:prune_rule=threshold}" --batch-sizes "${BATCH_SIZES:-1,2,4,8,16}" \
      --num-prompts "${NUM_PROMPTS:-24}" --max-new-tokens 64 --repeats 1 --schedule "${SCHEDULE:-groups}" \
      --no-progress --out "$OUT/sweep" 2>&1 | tee "$OUT/sweep.log"
    tar -czf "$OUT/sweep.tar.gz" -C "$OUT" sweep && rm -rf "$OUT/sweep"
    ;;
  sampling)
    pair
    specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${SAMPLING_METHODS:-ar,hf,chain,chain@sampling:chains=token,eagle2,eagle2@sampling:segments=token,eagle2@sampling:walk=host,dynatree@sampling:segments=block,dynatree@sampling:segments=token,eagle2@mars,dynatree,dynatree:calibrate=off,cast}" \
      --temperature 1 --seed 0 --num-prompts 12 \
      --max-new-tokens 64 --repeats 1 --no-progress --out "$OUT/sampling" 2>&1 | tee "$OUT/sampling.log"
    tar -czf "$OUT/sampling.tar.gz" -C "$OUT" sampling && rm -rf "$OUT/sampling"
    ;;
  profile)  # where a step's time goes (GPU busy or idle, kernels, host syncs and real waits a step, where the waits are): profile_step.py
    pair
    $PY benchmarks/gpu/profile_step.py --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${PROFILE_METHODS:-chain,eagle2,cast,dynatree}" --stacks --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log"
    tar -czf "$OUT/profile.tar.gz" -C "$OUT" profile && rm -rf "$OUT/profile"
    ;;
  host)  # where the host's time goes in a step, by function (host_profile.py; pyinstrument from a carried wheel folder, WHEELS)
    pair
    $PY -c "import pyinstrument" 2>/dev/null || $PY -m pip install -q --no-index --no-deps "${WHEELS:-.gpuwheels}"/pyinstrument-*.whl >>"$OUT/install.log" 2>&1 || { echo "no pyinstrument: carry its wheel in ${WHEELS:-.gpuwheels}"; exit 1; }
    $PY benchmarks/gpu/host_profile.py --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${HOST_METHODS:-chain,eagle2,cast,dynatree}" --out "$OUT/host" 2>&1 | grep -v "Loading weights" | tee "$OUT/host.log"
    tar -czf "$OUT/host.tar.gz" -C "$OUT" host && rm -rf "$OUT/host"
    ;;
  trace)  # per-step draft forwards, nodes and times, and CAST's predictions beside them (step_trace.py), at B = 1 and TRACE_B
    pair
    per_batch_size step_trace.py trace "${TRACE_METHODS:-chain,eagle2,cast,cast:prune_rule=threshold,dynatree}" "${TRACE_B:-8}"
    ;;
  ab)  # the same bench twice in one call: this tree's specdec, then an older copy of the package (OLD_PKG, a folder
      # holding specdec/: `git archive REV specdec | tar -x -C .oldpkg --exclude='specdec/assets/*'`, carried)
    pair
    [ -d "${OLD_PKG:-.oldpkg}/specdec" ] || { echo "no older package at ${OLD_PKG:-.oldpkg}/specdec"; exit 1; }
    for version in new old; do
      pythonpath=""; [ "$version" = old ] && pythonpath="$(cd "${OLD_PKG:-.oldpkg}" && pwd)"
      # from a neutral folder: the repository root first on sys.path would shadow PYTHONPATH
      (cd /tmp && PYTHONPATH="$pythonpath" $PY -c "import specdec; print('$version: specdec from', specdec.__file__)") | tee -a "$OUT/ab.log"
      (cd /tmp && PYTHONPATH="$pythonpath" timeout "${AB_LIMIT_S:-200}" specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
        --methods "${AB_METHODS:-ar,chain,eagle2,cast,dynatree}" --batch-sizes "${AB_BATCH_SIZES:-1,8}" --num-prompts "${NUM_PROMPTS:-24}" --max-new-tokens 64 --repeats 1 \
        --no-progress --out "$OUT/ab-$version") 2>&1 | grep -v "Loading weights" | tail -40 | tee -a "$OUT/ab.log"
      tar -czf "$OUT/ab-$version.tar.gz" -C "$OUT" "ab-$version" && rm -rf "$OUT/ab-$version"
    done
    ;;
  levels)  # captured drafting levels (SPECDEC_CAPTURE_LEVELS=1): their CUDA tests, then on / off in alternating rounds
           # of one process (levels_ab.py) at B = 1 and LEVELS_B, drafts checked equal between the modes (CAST's plans
           # follow its measured step times, so its drafts may differ); greedy, then (unless LEVELS_T1=0; it is also
           # a stage of its own, for a second call) at T = 1 (sampled children, one seed) at B = 1
    serial=(-n 0); $PY -c "import xdist" 2>/dev/null || serial=(-o addopts=-q)
    timeout 300 $PY -m pytest -q -p no:cacheprovider "${serial[@]}" tests/test_static_shapes.py tests/test_graph_replay_semantics.py -k "level or graph" -rs 2>&1 | tail -15 | tee "$OUT/levels.log"
    pair
    per_batch_size levels_ab.py levels "${LEVELS_METHODS:-chain,eagle2,static,dynatree,cast}" "${LEVELS_B:-8}"
    [ "${LEVELS_T1:-1}" = 0 ] || levels_t1
    ;;
  levels-t1)  # the T = 1 half of `levels`
    pair
    levels_t1
    ;;
  unmeasured)  # what earlier leases left unmeasured, in one call (greedy, B = 1, 2, 8): CAST deciding from its plan
              # (reads_while_drafting off, the CUDA default since 2026-11-26) against reading, DynaTree's measured free
              # width at B >= 2 and the captured-levels default, against the chain and EAGLE-2
    pair
    timeout "${UNMEASURED_LIMIT_S:-420}" specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${UNMEASURED_METHODS:-ar,chain,eagle2,dynatree,cast,cast:reads_while_drafting=on}" --batch-sizes "${BATCH_SIZES:-1,2,8}" \
      --num-prompts "${NUM_PROMPTS:-16}" --max-new-tokens 64 --repeats 1 --schedule "${SCHEDULE:-groups}" --no-progress --out "$OUT/unmeasured" 2>&1 | grep -v "Loading weights" | tee "$OUT/unmeasured.log"
    tar -czf "$OUT/unmeasured.tar.gz" -C "$OUT" unmeasured && rm -rf "$OUT/unmeasured"
    ;;
  unmeasured-t1)  # the same at T = 1, B = 1 and 8: DynaTree's free_sampled_children (6, against 3), CAST unread / read
    pair
    timeout "${UNMEASURED_LIMIT_S:-420}" specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${UNMEASURED_METHODS:-ar,chain,eagle2,dynatree,dynatree:free_sampled_children=3,cast,cast:reads_while_drafting=on}" --batch-sizes "${BATCH_SIZES:-1,8}" \
      --temperature 1 --seed 0 --num-prompts "${NUM_PROMPTS:-16}" --max-new-tokens 64 --repeats 1 --schedule "${SCHEDULE:-groups}" --no-progress --out "$OUT/unmeasured-t1" 2>&1 | grep -v "Loading weights" | tee "$OUT/unmeasured-t1.log"
    tar -czf "$OUT/unmeasured-t1.tar.gz" -C "$OUT" unmeasured-t1 && rm -rf "$OUT/unmeasured-t1"
    ;;
  depth-t1)  # DynaTree's depth inside its free width at T = 1, B = 1: the phase-3 history rule (the default, whose D_0
             # wandered from 3 to 8 on the CPU), D_0 held at 5 (phase 2) and started at 8, against the chain and EAGLE-2
             # (benchmarks/dynatree-free-children/NOTE.md, session 36)
    pair
    timeout "${UNMEASURED_LIMIT_S:-420}" specdec bench --target "$PAIR/target" --draft "$PAIR/draft" --prompts "$PAIR/prompts.jsonl" --device "$DEVICE" \
      --methods "${DEPTH_METHODS:-ar,chain,eagle2,dynatree,dynatree:phase=2,dynatree:d0=8}" --temperature 1 --seed 0 --num-prompts "${NUM_PROMPTS:-16}" \
      --max-new-tokens 64 --repeats 1 --no-progress --out "$OUT/depth-t1" 2>&1 | grep -v "Loading weights" | tee "$OUT/depth-t1.log"
    tar -czf "$OUT/depth-t1.tar.gz" -C "$OUT" depth-t1 && rm -rf "$OUT/depth-t1"
    ;;
  compile)  # torch.compile of the static forward (benchmarks/torch-compile-cpu): the pair's target, AR one-token forwards
            # at B = 1 and COMPILE_B (8), eager (dynamic, static shapes), the runner's CUDA graphs, compiled alone and
            # compiled inside the CUDA graphs; keys and values split per layer (specdec's shared storage makes compiled
            # forwards rebuild it every write), and the shared layout's graphs beside them as the baseline
    pair
    for b in 1 "${COMPILE_B:-8}"; do
      $PY benchmarks/gpu/compile_probe.py --model "$PAIR/target" --device "$DEVICE" --batch-size "$b" --layout shared \
        --modes dynamic,graphs 2>&1 | grep -v "Loading weights" | tee -a "$OUT/compile.log"
      $PY benchmarks/gpu/compile_probe.py --model "$PAIR/target" --device "$DEVICE" --batch-size "$b" --layout split-kv \
        --modes graphs,compiled,compiled-graphs 2>&1 | grep -v "Loading weights" | tee -a "$OUT/compile.log"
    done
    ;;
  pair)  # the synthetic pair alone (for a call that runs other things beside its build)
    pair
    ;;
  costs)  # the cost profiles measured on this machine (CAST's tables, DynaTree's free width), for reading back
    tar -czf "$OUT/costs.tar.gz" -C "$SPECDEC_CACHE_DIR" cost-profiles
    ;;
  *) echo "unknown stage $stage (next, tests, smoke, b1, sweep, sampling, profile, host, trace, ab, levels, levels-t1, unmeasured, unmeasured-t1, depth-t1, compile, pair, costs)"; exit 2 ;;
esac
