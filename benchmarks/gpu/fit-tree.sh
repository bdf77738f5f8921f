#!/usr/bin/env bash
# Fit the working tree into the device tool's 64 MiB for a GPU call, and restore it after.
#
#   bash benchmarks/gpu/fit-tree.sh on    # benchmarks/ (all but benchmarks/gpu's own files) and the bundled LVLM leave the index
#   ... device-tool calls ...
#   bash benchmarks/gpu/fit-tree.sh off   # the index is HEAD's again; commit only after this
#
# The files stay on disk; only git's index and .git/info/exclude change, which is what decides what
# the device tool sends (tracked files plus untracked files git does not ignore). With `on`, the
# tests that read benchmarks/ reports and tests/test_bundled_lvlm.py cannot pass on the device
# (run.sh's `tests` stage leaves the latter out).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
lines=('/benchmarks/*' '!/benchmarks/gpu/' '/benchmarks/gpu/*/' '/specdec/assets/lvlm/')
case "${1:-}" in
  on)
    if ! git diff --cached --quiet; then echo "the index has staged changes: commit or unstage them first" >&2; exit 1; fi
    git ls-files -z benchmarks | grep -zv '^benchmarks/gpu/[^/]*$' | xargs -0 -r git rm -q --cached  # the runner stays, reports go
    git rm -r -q --cached --ignore-unmatch specdec/assets/lvlm
    for line in "${lines[@]}"; do grep -qxF -- "$line" "$exclude" 2>/dev/null || echo "$line" >>"$exclude"; done
    bytes=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb | tail -1 | cut -f1)
    echo "the device tool would send $((bytes / 1048576)) MiB (limit 64)"
    ;;
  off)
    git reset -q
    for line in "${lines[@]}"; do grep -vxF -- "$line" "$exclude" >"$exclude.tmp" || true; mv "$exclude.tmp" "$exclude"; done
    git status --short | head
    ;;
  *) echo "usage: fit-tree.sh on|off" >&2; exit 2 ;;
esac
