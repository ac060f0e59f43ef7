#!/usr/bin/env bash
# A change against the code it started from, in one GPU call: both built on the GPU machine from
# the same tree and run alternately, so that what drifts between calls (the machine, its clocks,
# another tenant) stays out of the comparison.
#
#   bench/ab_gpu.sh --prepare REV       on the machine with the git checkout, before the call
#   bench/ab_gpu.sh [--model lenet|resnet18] [--epochs N] [--rounds R] [--trace] [--tests TAGS]
#                   [--env NAME=VALUE] [-- BENCH_TRAIN_FLAGS...]           on the GPU machine
#
# --prepare writes .ab-base/ (git-ignored: name it in what travels with the tree): every file
# that differs between REV and the working tree, as it is at REV, .ab-base/ADDED, the files
# the tree has and REV lacks, and .ab-base/TREE, the checksum of every file of the tree then (a
# run refuses a tree changed since). The run puts those in place (the added files aside), builds
# bench_train as "base", puts the tree back and builds it again ("new"; only what changed
# recompiles), then runs base and new R times in turn (default 2): bench_train --model M
# --epochs N (default 4) with TANDEM_CUDNN_BENCHMARK=1 and the flags after "--" (default for
# resnet18: --channels-last --precision bf16). It prints each run's images/s and the medians.
# --trace adds the kernel timeline of one replayed step of each (bench/kernel_timeline.cpp,
# bench/timeline_summary.py) and bench/timeline_diff.py's table, kernel by kernel; --tests runs
# tandem_tests TAGS on the new build first. Logs, the runs' JSON lines and the timelines in $OUT.
# --env NAME=VALUE compares a switch instead of two revisions: one build of the tree, "base" its
# runs with NAME=VALUE in the environment (say TANDEM_WGRAD_STREAM=0), "new" without; no --prepare.
# --env may be given more than once: "base" then has all of them.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=.ab-base

if [ "${1:-}" = --prepare ]; then
  rev=${2:?"ab_gpu.sh --prepare REV: which revision is the base?"}
  git rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "ab_gpu.sh: $rev is not a commit here" >&2; exit 2; }
  rm -rf "$BASE_DIR" && mkdir -p "$BASE_DIR/files" || exit 1
  : > "$BASE_DIR/ADDED"
  # Tracked files that differ from REV (changed, added or deleted since), and new untracked ones.
  { git diff --name-only "$rev" --; git ls-files --others --exclude-standard; } | sort -u |
    while IFS= read -r f; do
      case "$f" in "$BASE_DIR"/* | bench/ab_gpu.sh) continue ;; esac  # not the script that runs
      if git cat-file -e "$rev:$f" 2> /dev/null; then
        mkdir -p "$BASE_DIR/files/$(dirname "$f")" && git show "$rev:$f" > "$BASE_DIR/files/$f" || exit 1
      else
        echo "$f" >> "$BASE_DIR/ADDED"
      fi
    done || exit 1
  git rev-parse "$rev" > "$BASE_DIR/REV"
  # The tree as it is now, file by file: a change made after --prepare would be built into
  # "base" as well (only the files that differed here go back to REV), so the run refuses it.
  { git ls-files; git ls-files --others --exclude-standard; } | sort -u |
    grep -v -e "^$BASE_DIR/" -e '^bench/ab_gpu.sh$' | while IFS= read -r f; do [ -f "$f" ] && sha1sum "$f"; done \
    > "$BASE_DIR/TREE" || exit 1
  echo "ab_gpu.sh: $BASE_DIR holds $(find "$BASE_DIR/files" -type f | wc -l) files as at $(cut -c1-12 "$BASE_DIR/REV")" \
    "and $(wc -l < "$BASE_DIR/ADDED") added since"
  exit 0
fi

MODEL=resnet18 EPOCHS=4 ROUNDS=2 TRACE=0 TAGS="" BASE_ENV="" BASE_ENVS=() FLAGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift ;;
    --epochs) EPOCHS=$2; shift ;;
    --rounds) ROUNDS=$2; shift ;;
    --trace) TRACE=1 ;;
    --tests) TAGS=$2; shift ;;
    --env)
      [[ "$2" =~ ^[A-Z_][A-Z0-9_]*=.*$ ]] || { echo "ab_gpu.sh: --env takes NAME=VALUE, got $2" >&2; exit 2; }
      BASE_ENVS+=("$2") BASE_ENV="${BASE_ENV:+$BASE_ENV }$2"; shift ;;
    --) shift; FLAGS=("$@"); break ;;
    *) echo "ab_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
case "$MODEL" in lenet | resnet18) ;; *) echo "ab_gpu.sh: --model $MODEL is not lenet or resnet18" >&2; exit 2 ;; esac
[[ "$EPOCHS" =~ ^[1-9][0-9]*$ && "$ROUNDS" =~ ^[1-9][0-9]*$ ]] ||
  { echo "ab_gpu.sh: --epochs and --rounds take whole numbers from 1, got $EPOCHS and $ROUNDS" >&2; exit 2; }
[ ${#FLAGS[@]} -eq 0 ] && [ "$MODEL" = resnet18 ] && FLAGS=(--channels-last --precision bf16)
[ -n "$BASE_ENV" ] || [ -f "$BASE_DIR/REV" ] || { echo "ab_gpu.sh: no $BASE_DIR here: run bench/ab_gpu.sh --prepare REV first" >&2; exit 2; }
if [ -z "$BASE_ENV" ] && [ -f "$BASE_DIR/TREE" ] && ! changed=$(sha1sum --check --quiet "$BASE_DIR/TREE" 2>&1); then
  echo "ab_gpu.sh: the tree changed since --prepare ($(echo "$changed" | head -3 | tr '\n' ' ')...):" \
    "run bench/ab_gpu.sh --prepare $(cut -c1-12 "$BASE_DIR/REV") again" >&2
  exit 2
fi
. bench/gpu_env.sh

# The tree as it was at REV, and back. A file of the tree that REV lacks goes aside; one that
# REV has and the tree lacks is removed again on the way back.
SAVED=$(mktemp -d)
to_base() {
  (cd "$BASE_DIR/files" && find . -type f) | while IFS= read -r f; do
    if [ -e "$f" ]; then mkdir -p "$SAVED/tree/$(dirname "$f")" && cp -p "$f" "$SAVED/tree/$f"; else echo "$f" >> "$SAVED/absent"; fi
    mkdir -p "$(dirname "$f")" && cp "$BASE_DIR/files/$f" "$f"
  done
  while IFS= read -r f; do
    [ -e "$f" ] && mkdir -p "$SAVED/added/$(dirname "$f")" && mv "$f" "$SAVED/added/$f"
  done < "$BASE_DIR/ADDED"
}
to_tree() {
  [ -d "$SAVED/tree" ] && (cd "$SAVED/tree" && find . -type f) | while IFS= read -r f; do cp "$SAVED/tree/$f" "$f"; touch "$f"; done
  [ -f "$SAVED/absent" ] && while IFS= read -r f; do rm -f "$f"; done < "$SAVED/absent"
  [ -d "$SAVED/added" ] && (cd "$SAVED/added" && find . -type f) | while IFS= read -r f; do mv "$SAVED/added/$f" "$f"; touch "$f"; done
  rm -rf "$SAVED"
}
trap '[ -d "$SAVED" ] && to_tree' EXIT

TARGETS=(bench_train)
[ "$TRACE" = 1 ] && TARGETS+=(tandem_kernel_timeline)
if [ -z "$BASE_ENV" ]; then
  echo "== base: $(cut -c1-12 "$BASE_DIR/REV")"
  to_base
  build_gpu "${TARGETS[@]}" || exit 1
  BASE_BIN=$(mktemp) && cp build-gpu/bench/bench_train "$BASE_BIN" && chmod +x "$BASE_BIN" || exit 1
  to_tree
fi
echo "== new: the tree${BASE_ENV:+ (base: the same build with $BASE_ENV)}"
[ -n "$TAGS" ] && TARGETS+=(tandem_tests)
build_gpu "${TARGETS[@]}" || exit 1
NEW_BIN=./build-gpu/bench/bench_train
[ -n "$BASE_ENV" ] && BASE_BIN=$(mktemp) && cp "$NEW_BIN" "$BASE_BIN" && chmod +x "$BASE_BIN"

if [ -n "$TAGS" ]; then
  ./build-gpu/tests/tandem_tests "$TAGS" > "$OUT/ab_tests.log" 2>&1
  echo "tests $TAGS (rc $?): $(grep -E '^(All tests passed|test cases:)' "$OUT/ab_tests.log" | tail -1)"
  grep -B5 -A15 FAILED "$OUT/ab_tests.log" | head -60
fi

run() {  # BINARY EPOCHS [ENV...]: one bench_train run, its JSON line on stdout
  local bin=$1 epochs=$2; shift 2
  env TANDEM_CUDNN_BENCHMARK=1 "$@" "$bin" --model "$MODEL" --data "$DATA" --devices cuda:0 --epochs "$epochs" \
    "${FLAGS[@]}" 2>> "$OUT/ab.err" | tail -1
}
R=$OUT/ab.jsonl
: > "$R"
echo "== $MODEL${FLAGS[*]:+ ${FLAGS[*]}}, $EPOCHS epochs, base and new in turn"
for ((i = 1; i <= ROUNDS; i++)); do
  for v in base new; do
    bin=$NEW_BIN envs=(); [ $v = base ] && bin=$BASE_BIN envs=("${BASE_ENVS[@]}")
    line=$(run "$bin" "$EPOCHS" "${envs[@]}")
    [ -n "$line" ] || { echo "$v: no result (the log: $OUT/ab.err)"; tail -3 "$OUT/ab.err"; continue; }
    echo "{\"variant\": \"$v\", ${line#\{}" >> "$R"
    echo "$v $line"
  done
done
python3 - "$R" << 'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = {v: statistics.median([r["images_per_s"] for r in runs if r["variant"] == v] or [0]) for v in ("base", "new")}
ratio = f", new/base {med['new'] / med['base']:.3f}" if med["base"] else ""
print(f"median images/s: base {med['base']:.0f}, new {med['new']:.0f}{ratio}")
EOF

if [ "$TRACE" = 1 ]; then
  LIB=$PWD/build-gpu/bench/libtandem_kernel_timeline.so
  for v in base new; do
    bin=$NEW_BIN envs=(); [ $v = base ] && bin=$BASE_BIN envs=("${BASE_ENVS[@]}")
    run "$bin" 2 "${envs[@]}" CUDA_INJECTION64_PATH="$LIB" TANDEM_TIMELINE="$OUT/ab_$v.trace.json" > /dev/null
    python3 bench/timeline_summary.py "$OUT/ab_$v.trace.json" --label $v --json "$OUT/ab_$v.summary.json" \
      > "$OUT/ab_$v.timeline.txt" 2>&1 && rm -f "$OUT/ab_$v.trace.json"
    head -1 "$OUT/ab_$v.timeline.txt"
  done
  python3 bench/timeline_diff.py "$OUT/ab_base.summary.json" "$OUT/ab_new.summary.json" | tee "$OUT/ab_diff.txt"
fi
rm -f "$BASE_BIN"
