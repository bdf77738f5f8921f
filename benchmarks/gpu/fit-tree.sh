#!/usr/bin/env bash
# Fit the working tree into the device tool's 64 MiB for a GPU call, and restore it after.
#
#   bash benchmarks/gpu/fit-tree.sh on    # benchmarks/ (all but benchmarks/gpu's own files), docs/ and the bundled LVLM leave the index
#   ... device-tool calls ...
#   bash benchmarks/gpu/fit-tree.sh off   # the index is HEAD's again; commit only after this
#   bash benchmarks/gpu/fit-tree.sh size  # the bytes `on` would send, touching nothing (tests/test_gpu_tree.py)
#
# The files stay on disk; only git's index and .git/info/exclude change, which is what decides what
# the device tool sends (tracked files plus untracked files git does not ignore). With `on`, the
# tests that read benchmarks/ reports, tests/test_docs.py and tests/test_bundled_lvlm.py cannot pass
# on the device (run.sh's `tests` stage leaves the last two out). docs/ left with session 46: the tree
# had grown to 64.01 MiB without it (the bundled pair's weights alone are 60.1 MiB).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
lines=('/benchmarks/*' '!/benchmarks/gpu/' '/benchmarks/gpu/*/' '/specdec/assets/lvlm/' '/docs/')
LIMIT=$((64 * 1048576))
select_paths() {  # NUL-separated paths in; out, those `on` sends (`select_paths sent`) or takes out of the index (`select_paths dropped`); the same rules as `lines`
  local f kind
  while IFS= read -r -d '' f; do
    case "$f" in
      benchmarks/gpu/*/*) kind=dropped ;;
      benchmarks/gpu/*) kind=sent ;;
      benchmarks/* | docs/* | specdec/assets/lvlm/*) kind=dropped ;;
      *) kind=sent ;;
    esac
    if [ "$kind" = "$1" ]; then printf '%s\0' "$f"; fi
  done
}
sent_bytes() {  # what the device tool would send: tracked files and untracked ones git does not ignore
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | select_paths sent | xargs -0 -r du -b 2>/dev/null | awk '{s += $1} END {print s + 0}'
}
case "${1:-}" in
  on)
    if ! git diff --cached --quiet; then echo "the index has staged changes: commit or unstage them first" >&2; exit 1; fi
    git ls-files -z | select_paths dropped | xargs -0 -r git rm -q --cached  # the runner stays; reports, docs and the LVLM go
    for line in "${lines[@]}"; do grep -qxF -- "$line" "$exclude" 2>/dev/null || echo "$line" >>"$exclude"; done
    bytes=$(sent_bytes)
    printf "the device tool would send %d.%02d MiB (limit 64)\n" $((bytes / 1048576)) $(((bytes % 1048576) * 100 / 1048576))
    if [ "$bytes" -gt "$LIMIT" ]; then echo "over the limit: take more out of the index (the bundled target's weights if the tests stage is not needed)" >&2; fi
    ;;
  size)
    sent_bytes
    ;;
  off)
    git reset -q
    for line in "${lines[@]}"; do grep -vxF -- "$line" "$exclude" >"$exclude.tmp" || true; mv "$exclude.tmp" "$exclude"; done
    git status --short | head
    ;;
  *) echo "usage: fit-tree.sh on|off|size" >&2; exit 2 ;;
esac
