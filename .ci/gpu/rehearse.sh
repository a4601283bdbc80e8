#!/usr/bin/env bash
# The GPU lane rehearsed on this CPU machine (`.ci/gpu/run.sh rehearse`, `make rehearse-gpu`):
# every call of the lane, as a GPU call runs it, where the reason it could fail is not the GPU.
#   1. .whl/ as the GPU call gets it (.ci/gpu/wheels.sh, when it is missing or older than
#      setup.cfg), and .science/ (tools/science_data.py, when missing)
#   2. an interpreter like the image's (.ci/gpu/rehearse_env.sh: CPython 3.12, torch 2.11.0,
#      Triton 3.6.0, numpy 2.5.2, transformers 5.17.0, pytest-xdist)
#   3. each call (kernels, bench, jobs, science) through run.sh with GPU_REHEARSE=1, into OUT/CALL:
#      the env step installs .whl/ into /tmp/site as on the GPU; the kernel tests run under
#      Triton's interpreter and tools/bench/kernel_report.py compiles for sm_80 and sm_90 under Triton
#      3.6; bench_model and bench_train run their CPU sizes (bench_kernel needs CUDA); the jobs
#      run on CPU ranks (fp16 and the V100 path need a GPU); the science step at a CPU budget.
# Every box is the GPU's times GPU_SCALE (2). OUT (runs/gpu-rehearse) gets each call's folder
# and summary.txt; exit 1 when any call fails, as the GPU call would.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/runs/gpu-rehearse}
SCALE=${GPU_SCALE:-2}
CALLS=${*:-kernels bench jobs science}
rm -rf "$OUT" && mkdir -p "$OUT" || exit 1
log=$OUT/rehearse.log
fail() { echo "rehearse: error: $*" | tee -a "$log" >&2; exit 1; }
# The books the jobs' datasets are built from go along in .whl/data, as wheels.sh carries them
if [ -z "${SHATTER_SHARED_DATA:-}" ] && [ -d ../shared/data/books ]; then
  export SHATTER_SHARED_DATA=$PWD/../shared/data
fi
if [ ! -f .whl/image.txt ] || [ setup.cfg -nt .whl/image.txt ]; then
  echo "rehearse: building .whl/ (bash .ci/gpu/wheels.sh)" | tee -a "$log"
  PYTHON=python3 bash .ci/gpu/wheels.sh >>"$log" 2>&1 || fail "bash .ci/gpu/wheels.sh failed: see $log"
fi
PY=$(bash .ci/gpu/rehearse_env.sh 2>>"$log" | tail -1)
[ -x "$PY" ] || fail "the interpreter was not built: see $log (.ci/gpu/rehearse_env.sh)"
# The env step once before the calls: DeepSpeed's CPU comm op is JIT-built here (a GPU needs none)
echo "rehearse: run.sh --env-step (installs .whl/ into /tmp/site, builds DeepSpeed's CPU op)" | tee -a "$log"
PYTHON=$PY GPU_REHEARSE=1 GPU_BUILD_OPS=1 bash .ci/gpu/run.sh --env-step >>"$log" 2>&1 || fail "the env step failed: see $log"
if [ ! -f .science/l128/index.json ]; then
  echo "rehearse: building .science/ (tools/science_data.py)" | tee -a "$log"
  PYTHONPATH=$PWD "$PY" tools/science_data.py >>"$log" 2>&1 || fail "tools/science_data.py failed: see $log"
fi
numpy=$(dirname "$(dirname "$PY")")/interpreter-numpy # Triton 3.6's interpreter's (run.sh)
failed=0
rows=()
for call in $CALLS; do
  t0=$SECONDS
  echo "rehearse: run.sh $call" | tee -a "$log"
  PYTHON=$PY GPU_REHEARSE=1 GPU_REHEARSE_NUMPY=$numpy GPU_SCALE=$SCALE GPU_BUDGET=$((570 * SCALE)) OUT=$OUT/$call \
    timeout -k 30 $((600 * SCALE)) bash .ci/gpu/run.sh "$call" >>"$log" 2>&1
  rc=$?
  ((rc)) && failed=1
  rows+=("$call: exit $rc, $((SECONDS - t0)) s (a GPU call has 600 s; here x$SCALE)")
done
{
  echo "rehearse: $SECONDS s in all, $("$PY" -c 'import sys, torch, triton; print("Python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)')"
  printf '%s\n' "${rows[@]}"
  for call in $CALLS; do
    echo "== $call"
    cat "$OUT/$call/summary.txt" 2>/dev/null || echo "(no summary: see $log)"
  done
} | tee "$OUT/summary.txt"
exit "$failed"
