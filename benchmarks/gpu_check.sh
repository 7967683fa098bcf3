#!/usr/bin/env bash
# One check of jaxscale on a bare GPU machine (an H200), under a hard time budget.
#
#     bash benchmarks/gpu_check.sh [--platform gpu|cpu] [--out DIR] [--budget SECONDS]
#                                  [--work DIR]
#
# The machine's Python (python, else python3; or $PYTHON) must already have jax with CUDA,
# flax, optax and orbax: nothing is downloaded. The steps, in this order (breadth first:
# one of everything, then the other batches, the unrolled compiles, the longest, last; a
# short budget cuts the repeats of what already ran once):
#
#   install          pip install --no-deps --no-build-isolation -e . (only when jaxscale
#                    does not already import from this checkout; PYTHONPATH has the
#                    checkout either way)
#   machine          nvidia-smi                       (cpu: uname -a, nproc)
#   devices          python -c 'import jax; print(jax.devices())'
#   imports          which of jaxscale's dependencies are missing (find_spec, no import;
#                    rich and matplotlib too: train and compare draw charts)
#   gpu-tests        JAXSCALE_GPU_TESTS=1 python -m pytest -m gpu -q tests/ (rc 5, no
#                    test collected, is no failure)
#   bench-mid-scan-b16, bench-1b-scan-b8
#                    jaxscale bench --platform gpu --json, bf16, attention auto (cuDNN),
#                    layers scanned, --steps 10 --warmup 2, --remat matmuls,none: one
#                    process per batch (an out-of-memory batch loses only its own rows;
#                    each row's memory is XLA's analysis of its own program). If mid
#                    fails, once more with --attention xla.
#   bench-mid-scan-b16-fp8, -fp8-block
#                    the same bench, remat none, under the fp8 policies (gpu only): fp8's
#                    products in FP8 where XLA rewrites them into FP8 GEMMs; fp8-block is
#                    an emulation (no per-tile kernel): its numerics, not its speed
#   profile-mid-b16  the same bench, remat none (its compile is a cache load), --steps 5
#                    under --profile: the top ops land in the JSON
#   train-mid        jaxscale train --model mid bf16, batch 8, at most 200 steps, lr 1e-3,
#                    stopping 0.1 nats above the entropy floor: the loss falls toward it
#   compare-small    jaxscale compare --platform gpu --devices 1 --model small (10 steps,
#                    5 timed): single and control
#   target-check     benchmarks/gpu_target_check.py: the same training steps compiled for
#                    the compile-only target (h100-1 / h200-1) and for this GPU, XLA's
#                    memory figures side by side (DIR/gpu_target_check.json; gpu only)
#   bench-mid-unroll-b16   the same as bench-mid-scan-b16 with --unroll
#   bench-mid-scan-b8, -b32, bench-1b-scan-b4, bench-1b-unroll-b8, bench-mid-unroll-b8,
#   -b32, bench-1b-unroll-b4
#
# Timeouts (seconds, on the GPU): install 90, machine 20, devices 60, imports 20, tests
# 150, each scanned bench 150, profile 90, train 150, compare 120, target-check 150,
# each unrolled bench 240.
#
# 1b's batches: `jaxscale memory --model 1b --batch B` gives model states 15.6 GB and
# activations 35 GB (b4) / 71 GB (b8) / 142 GB (b16) written out, 11 / 23 / 45 GB with
# flash attention; JAX takes 75% of the 141 GB (about 105 GB): b4 and b8 fit with any
# attention kernel, b16 only with cuDNN's.
#
# Budget: the whole run stops at --budget seconds (default 480). A step starts only if a
# third of its timeout is left in the budget (less 15 s kept for the summary), and then
# with its timeout cut to what is left; otherwise it is recorded as skipped. A failing or
# timed-out step is recorded and the next one runs.
#
# XLA flags: none are set (XLA_FLAGS as the environment has it, recorded in the JSON);
# the compilation cache is jaxscale's default (~/.cache/jaxscale/xla, or
# $JAXSCALE_CACHE_DIR), which makes the profile run's compile a load.
#
# --platform cpu: a dry run of the same steps on this CPU with tiny (for mid, and for
# compare's small) and tiny8 (for 1b), one batch each (4 and 2: the other batches repeat
# the same commands), fp32, 2 timed steps, 30 training steps, the gpu tests collected from
# their own files only (all skipped on a CPU), each step's timeout 180 s (a cold compile
# on two loaded cores takes minutes): it checks the script, not the speed. It writes
# DIR/gpu-cpu-dry-run.json and DIR/gpu_check-cpu-dry-run.log, never gpu.json.
#
# Writes DIR/gpu.json (benchmarks/mfu.py collect: date, device, versions, every step's
# status, rc and seconds, the bench rows, profile, train, compare and tests) and
# DIR/gpu_check.log (every command with its stdout and stderr); DIR defaults to
# benchmarks/results. Raw step outputs stay in --work (default a new temporary folder).
# Prints a table at the end. Exit status 1 if any step failed or timed out, else 0
# (skipped steps are listed, not failures).
set -u -o pipefail

PLATFORM=gpu
OUT=""
BUDGET=480
WORK=""
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while (( $# )); do
    case "$1" in
        --platform) PLATFORM=${2:?--platform needs gpu or cpu}; shift 2 ;;
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
        --work) WORK=${2:?--work needs a folder}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$PLATFORM" in gpu|cpu) ;; *) echo "gpu_check.sh: --platform gpu or cpu" >&2; exit 2 ;; esac
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget takes whole seconds" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK" || exit 2
if [[ $PLATFORM == gpu ]]; then
    JSON=$OUT/gpu.json LOG=$OUT/gpu_check.log
else
    JSON=$OUT/gpu-cpu-dry-run.json LOG=$OUT/gpu_check-cpu-dry-run.log
    export JAX_PLATFORMS=cpu  # the dry run stays on the CPU wherever it runs
fi
PY=${PYTHON:-$(command -v python || command -v python3)}
ORIGINAL_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # the checkout, installed or not
JAXSCALE=("$PY" -m jaxscale)
STARTED=$(date +%s)
RESERVE=15  # seconds kept for the summary
: > "$WORK/steps.tsv"
: > "$LOG"
FAILURES=0

say() { printf '[%4ds] %s\n' "$SECONDS" "$*" | tee -a "$LOG"; }

record() {  # NAME KIND STATUS RC START END TIMEOUT COMMAND
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$WORK/steps.tsv"
}

# step NAME KIND TIMEOUT COMMAND...: run COMMAND under the budget; stdout to WORK/NAME.out
step() {
    local name=$1 kind=$2 limit=$3
    shift 3
    local cmd left t0 t1 rc status
    printf -v cmd '%q ' "$@"
    left=$(( BUDGET - SECONDS - RESERVE ))
    if (( left < (limit + 2) / 3 || left < 5 )); then
        record "$name" "$kind" skipped "" "" "" "$limit" "$cmd"
        say "$name: skipped (${left} s of the budget left, its timeout is ${limit} s)"
        return 0
    fi
    (( limit > left )) && limit=$left
    printf '\n===== %s (%s), at %d s, timeout %d s\n$ %s\n' \
        "$name" "$kind" "$SECONDS" "$limit" "$cmd" >> "$LOG"
    t0=$EPOCHREALTIME
    timeout -k 5 "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
    rc=$?
    t1=$EPOCHREALTIME
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        5) if [[ $kind == tests ]]; then status=no-tests; else status=failed; fi ;;
        *) status=failed ;;
    esac
    [[ $status == failed || $status == timeout ]] && FAILURES=$((FAILURES + 1))
    { echo "--- stdout"; cat "$WORK/$name.out"; echo "--- stderr"; cat "$WORK/$name.err"
      echo "--- rc $rc ($status)"; } >> "$LOG"
    record "$name" "$kind" "$status" "$rc" "$t0" "$t1" "$limit" "$cmd"
    say "$name: $status (rc $rc, $(awk -v a="${t0/,/.}" -v b="${t1/,/.}" \
        'BEGIN { printf "%.1f", b - a }') s)"
}

# ---- what each platform runs: models, batches, steps, timeouts (seconds). HEAD: the
# headline batch of each model (run first, with everything else once); REST: afterwards.
if [[ $PLATFORM == gpu ]]; then
    MID=mid BIG=1b SMALL=small
    MID_HEAD=16 MID_REST=(8 32) BIG_HEAD=8 BIG_REST=(4)
    BENCH_STEPS=(--steps 10 --warmup 2) PROFILE_STEPS=(--steps 5 --warmup 2)
    PRECISION=(--precision bf16)
    # 40,000 documents pack into ~870 rows of 1,024 tokens: 200 steps of 8 see each about twice
    TRAIN=(--model mid --precision bf16 --batch-size 8 --steps 200 --lr 1e-3 --warmup 20
           --eval-every 25 --stop-gap 0.1 --train-docs 40000)
    COMPARE=(--model small --steps 10 --repeats 5)
    T_INSTALL=90 T_MACHINE=20 T_DEVICES=60 T_IMPORTS=20 T_TESTS=150 T_SCAN=150
    T_PROFILE=90 T_TRAIN=150 T_COMPARE=120 T_TARGET=150 T_UNROLL=240
else
    # the dry run checks the script, not speed: cheap models, and each kind of step once
    # (the other batches would run the very same commands again with another --batch)
    MID=tiny BIG=tiny8 SMALL=tiny
    MID_HEAD=4 MID_REST=() BIG_HEAD=2 BIG_REST=()
    BENCH_STEPS=(--steps 2 --warmup 1) PROFILE_STEPS=(--steps 2 --warmup 1)
    PRECISION=(--precision fp32)
    TRAIN=(--model tiny --batch-size 8 --steps 30 --warmup 5 --eval-every 10)
    COMPARE=(--model tiny --steps 3 --repeats 3)
    # generous: a cold compile on 2 loaded cores (the test suite beside it) takes minutes
    T_INSTALL=60 T_MACHINE=10 T_DEVICES=60 T_IMPORTS=10 T_TESTS=180 T_SCAN=180
    T_PROFILE=180 T_TRAIN=180 T_COMPARE=180 T_UNROLL=180
fi

bench() {  # bench NAME TIMEOUT MODEL BATCH [EXTRA...]
    local name=$1 limit=$2 model=$3 batch=$4
    shift 4
    step "$name" bench "$limit" "${JAXSCALE[@]}" bench --platform "$PLATFORM" --model "$model" \
        --batch "$batch" --remat matmuls,none "${PRECISION[@]}" "${BENCH_STEPS[@]}" --json "$@"
}

say "gpu_check: platform $PLATFORM, budget $BUDGET s, python $PY, out $OUT, work $WORK"

# ---- set-up and the machine
IMPORTED_HERE="import sys, jaxscale; sys.exit(not jaxscale.__file__.startswith('$ROOT/'))"
if (cd / && PYTHONPATH=$ORIGINAL_PYTHONPATH "$PY" -c "$IMPORTED_HERE" 2>/dev/null); then
    record install setup not-needed 0 "" "" "$T_INSTALL" "jaxscale imports from $ROOT"
    say "install: not needed (jaxscale imports from $ROOT)"
else
    step install setup "$T_INSTALL" "$PY" -m pip install --no-deps --no-build-isolation -q -e .
fi
if [[ $PLATFORM == gpu ]]; then
    step machine info "$T_MACHINE" nvidia-smi
else
    step machine info "$T_MACHINE" bash -c 'uname -a; nproc'
fi
step devices info "$T_DEVICES" "$PY" -c 'import jax; print(jax.devices())'
# what jaxscale needs and the machine may lack (nothing can be installed here): found by
# importlib.util.find_spec, without importing; a missing required one fails this step
step imports info "$T_IMPORTS" "$PY" -c "$(cat <<'PYTHON'
import importlib.util as u, sys
need = ('jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'numpy', 'ml_dtypes', 'rich',
        'matplotlib', 'pytest')
extra = ('hypothesis', 'datasketch')  # the CPU suite's: its test files import them
def found(m):
    try:
        return u.find_spec(m) is not None
    except ImportError:
        return False
missing = [m for m in need + extra if not found(m)]
print('missing:', ' '.join(missing) or 'none')
sys.exit(any(m in need for m in missing))
PYTHON
)"
# The gpu-marked tests, collected from tests/ (unless a CPU-suite module there would fail
# to import: then from the files that hold gpu-marked tests). tests/conftest.py runs them
# only with JAXSCALE_GPU_TESTS=1 and a GPU; on the dry run's CPU they are skipped.
TEST_PATHS=(tests/)
if [[ $PLATFORM == cpu ]]; then  # the dry run skips them all: collect only their files
    mapfile -t TEST_PATHS < <(grep -rl --include='test_*.py' 'mark\.gpu' tests)
elif grep -q '^missing:.*\(hypothesis\|datasketch\)' "$WORK/imports.out" 2>/dev/null; then
    mapfile -t TEST_PATHS < <(grep -rl --include='test_*.py' 'mark\.gpu' tests)
    say "gpu-tests: hypothesis or datasketch missing; collecting only ${TEST_PATHS[*]}"
fi
step gpu-tests tests "$T_TESTS" env JAXSCALE_GPU_TESTS=1 "$PY" -m pytest -m gpu -q \
    "${TEST_PATHS[@]}"

# ---- breadth first: each model's headline batch scanned, a profile, training, the
# compare, the target check, the headline unrolled; then the other batches (scanned,
# then unrolled)
bench "bench-$MID-scan-b$MID_HEAD" "$T_SCAN" "$MID" "$MID_HEAD"
if [[ $(tail -n 1 "$WORK/steps.tsv" | cut -f3) == failed ]]; then  # the attention kernel?
    bench "bench-$MID-scan-b$MID_HEAD-xla" "$T_SCAN" "$MID" "$MID_HEAD" --attention xla
fi
bench "bench-$BIG-scan-b$BIG_HEAD" "$T_SCAN" "$BIG" "$BIG_HEAD"
if [[ $PLATFORM == gpu ]]; then  # the fp8 policies beside bf16 (the dry run: covered by tests)
    for p in fp8 fp8-block; do
        step "bench-$MID-scan-b$MID_HEAD-$p" bench "$T_SCAN" "${JAXSCALE[@]}" bench \
            --platform gpu --model "$MID" --batch "$MID_HEAD" --remat none --precision "$p" \
            "${BENCH_STEPS[@]}" --json
    done
fi
step "profile-$MID-b$MID_HEAD" profile "$T_PROFILE" "${JAXSCALE[@]}" bench \
    --platform "$PLATFORM" --model "$MID" --batch "$MID_HEAD" --remat none \
    "${PRECISION[@]}" "${PROFILE_STEPS[@]}" --profile "$WORK/profile" --json
step "train-${TRAIN[1]}" train "$T_TRAIN" "${JAXSCALE[@]}" train --platform "$PLATFORM" \
    "${TRAIN[@]}" --out "$WORK/train" --json
step "compare-$SMALL" compare "$T_COMPARE" "${JAXSCALE[@]}" compare --platform "$PLATFORM" \
    --devices 1 "${COMPARE[@]}" --out "$WORK/compare" --json
if [[ $PLATFORM == gpu ]]; then  # the compile-only GPU target against this GPU itself
    step target-check target "$T_TARGET" "$PY" benchmarks/gpu_target_check.py \
        --model "$SMALL" --out "$OUT/gpu_target_check.json"
fi
bench "bench-$MID-unroll-b$MID_HEAD" "$T_UNROLL" "$MID" "$MID_HEAD" --unroll
for b in "${MID_REST[@]}"; do bench "bench-$MID-scan-b$b" "$T_SCAN" "$MID" "$b"; done
for b in "${BIG_REST[@]}"; do bench "bench-$BIG-scan-b$b" "$T_SCAN" "$BIG" "$b"; done
bench "bench-$BIG-unroll-b$BIG_HEAD" "$T_UNROLL" "$BIG" "$BIG_HEAD" --unroll
for b in "${MID_REST[@]}"; do bench "bench-$MID-unroll-b$b" "$T_UNROLL" "$MID" "$b" --unroll; done
for b in "${BIG_REST[@]}"; do bench "bench-$BIG-unroll-b$b" "$T_UNROLL" "$BIG" "$b" --unroll; done

# ---- one JSON and the table
say "collecting into $JSON"
"$PY" "$ROOT/benchmarks/mfu.py" collect --work "$WORK" --out "$JSON" --platform "$PLATFORM" \
    --budget "$BUDGET" --started "$STARTED" --log "$LOG" 2>&1 | tee -a "$LOG"
collected=${PIPESTATUS[0]}
(( collected != 0 )) && { say "collect failed (rc $collected)"; FAILURES=$((FAILURES + 1)); }
say "done in $SECONDS s: $FAILURES failed step(s); log $LOG"
(( FAILURES == 0 ))
