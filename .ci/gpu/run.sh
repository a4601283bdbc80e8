#!/usr/bin/env bash
# The GPU lane and the GPU figures in one command, on a GPU machine without network access
# (docs/benchmarks.md, "Running the GPU figures"). From the repository root, with .whl/ built by
# .ci/gpu/wheels.sh beside it:
#
#   bash .ci/gpu/run.sh [tests|bench|all|env] [pytest arguments...]
#
#   env    always first: installs .whl/*.whl into /tmp/site, puts the console scripts the tests
#          call next to the interpreter, prints the GPU, torch/triton and the carried packages
#   tests  python3 -m pytest -q -s -m gpu --timeout $GPU_TEST_TIMEOUT [pytest arguments...]: every
#          test runs (no -x), each in its own time box (GPU_TEST_TIMEOUT, 300 s: a cold Triton
#          cache compiles and autotunes every kernel config in the first test that uses it);
#          $OUT/junit.xml gives each test's result and seconds
#   bench  tools/bench_kernel.py, tools/bench_model.py and tools/bench_train.py on the GPU
#   all    (the default) tests, then bench, each in a shorter time box
#
# Each step runs under `timeout` so that the whole ends within GPU_BUDGET seconds (570); a failed
# step does not stop the next. Each step's output goes to $OUT/<step>.log (OUT defaults to
# runs/gpu/), and $OUT/summary.txt, written last, gives each step's exit status and seconds, then
# one table of the tests (test, pass/fail, seconds) and each failure's first line.
# GPU_DRY=1 prints the steps without running them. PYTHON (python3) is the interpreter.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
MODE=${1:-all}
[ $# -gt 0 ] && shift
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/runs/gpu}
BUDGET=${GPU_BUDGET:-570}
DRY=${GPU_DRY:-0}
SITE=${GPU_SITE:-/tmp/site}
PER_TEST=${GPU_TEST_TIMEOUT:-300}
# The tests the lane runs (pytest selection arguments): one line to change.
TEST_SELECTION=(-m gpu)
case $MODE in
  tests) T_TESTS=520 ;;
  bench) T_KERNEL=150 T_MODEL=180 T_TRAIN=180 ;;
  all) T_TESTS=250 T_KERNEL=80 T_MODEL=100 T_TRAIN=100 ;;
  env | --env-step) ;;
  *) echo "run.sh: error: unknown step '$MODE' (tests, bench, all or env) in $0" >&2; exit 2 ;;
esac
[ "$MODE" = --env-step ] || mkdir -p "$OUT" || { echo "run.sh: error: cannot create $OUT (OUT)" >&2; exit 1; }
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${SHATTER_SHARED_DATA:-}" ] && [ -d .whl/data ]; then
  export SHATTER_SHARED_DATA="$PWD/.whl/data"
fi
SUMMARY=()
FAILED=0

# step NAME SECONDS COMMAND...: run COMMAND under timeout, output to $OUT/NAME.log, in the budget.
# SIG=INT step ...: the time box interrupts as Ctrl-C does (pytest then still writes its XML).
step() {
  local name=$1 limit=$2 left log=$OUT/$1.log t0 rc
  shift 2
  left=$((BUDGET - SECONDS - 15))
  ((limit > left)) && limit=$left
  if ((limit < 30)); then
    SUMMARY+=("$name: skipped, $left s left of GPU_BUDGET=$BUDGET")
    return
  fi
  echo "+ timeout $limit $*" | tee "$log"
  if [ "$DRY" = 1 ]; then
    SUMMARY+=("$name: dry run")
    return
  fi
  t0=$SECONDS
  timeout -s "${SIG:-TERM}" -k 20 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  ((rc == 124 || rc == 137)) && rc="$rc (timed out after $limit s)"
  [ "$rc" = 0 ] || FAILED=1
  SUMMARY+=("$name: exit $rc, $((SECONDS - t0)) s, $log")
}

# The wheels are CPython 3.12 x86-64 builds: another interpreter keeps its own packages.
install_wheels() {
  local tag
  tag=$("$PY" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "run.sh: no .whl/*.whl (bash .ci/gpu/wheels.sh builds them): using $PY's own packages"
  elif [ "$tag" != cp312-x86_64 ]; then
    echo "run.sh: $PY is $tag, the wheels are cp312-x86_64: using its own packages"
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || return 1
  fi
  scripts
}

# The tests start `shatter-data`, `shatter-extend` and `deepspeed` from the interpreter's own
# directory (tests/train/shardutil.py, tests/*/test_gpu.py): put what is missing there.
scripts() {
  local bin
  bin=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')
  "$PY" - "$bin" <<'EOF' || return 1
import configparser, os, sys
bin_dir = sys.argv[1]
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
for line in cfg["options.entry_points"]["console_scripts"].split("\n"):
    if "=" not in line:
        continue
    name, target = (s.strip() for s in line.split("="))
    module, func = target.split(":")
    path = os.path.join(bin_dir, name)
    if os.path.exists(path):
        print(f"run.sh: {path} is there")
        continue
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    os.chmod(path, 0o755)
    print(f"run.sh: wrote {path}")
EOF
  if [ -d "$SITE/bin" ]; then
    cp -nv "$SITE"/bin/* "$bin"/ || return 1
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  "$PY" - <<'EOF'
import importlib, sys
print(sys.version.split()[0], sys.executable)
try:
    import torch, triton
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        cap = torch.cuda.get_device_capability(0)
        print(f"{p.name}: capability {cap}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    else:
        print("torch sees no CUDA device")
except ImportError as e:
    print(f"torch/triton: import failed: {e}")
bad = 0
for name in ("torch", "triton", "apache_beam", "deepspeed", "datasets", "pydantic", "zstandard", "mwparserfromhell",
             "pyarrow", "numpy", "sentencepiece", "pipeline.cli", "train.engine", "shatter"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '')} {m.__file__}")
    except Exception as e:
        bad = 1
        print(f"{name}: import failed: {type(e).__name__}: {e}")
sys.exit(bad)
EOF
  local rc=$?
  "$PY" -m pip check || true
  return "$rc"
}

if [ "$MODE" = --env-step ]; then # the env step itself, in its own process under timeout
  install_wheels
  exit
fi
step env 150 bash "$0" --env-step
case $MODE in tests | all)
  rm -f "$OUT/junit.xml"
  SIG=INT step tests "$T_TESTS" "$PY" -m pytest -q -s "${TEST_SELECTION[@]}" --timeout "$PER_TEST" \
    --junitxml "$OUT/junit.xml" -o junit_family=xunit1 "$@" ;;
esac
case $MODE in bench | all)
  step bench_kernel "$T_KERNEL" "$PY" tools/bench_kernel.py --lengths 128,256,512,1024 --dtype bf16
  step bench_model "$T_MODEL" "$PY" tools/bench_model.py --device cuda --lengths 512,1024,2048 \
    --batch-tokens 16384 --markdown
  step bench_train "$T_TRAIN" "$PY" tools/bench_train.py --device cuda --precision bf16 \
    --sizes base --archs bert,shatter,bert-rpe,bert-rab --steps 20
  ;;
esac

{
  echo "run.sh $MODE: $SECONDS s of GPU_BUDGET=$BUDGET"
  grep -hE '^(NVIDIA|GPU 0|torch )' "$OUT/env.log" 2>/dev/null
  printf '%s\n' "${SUMMARY[@]}"
  if [ -f "$OUT/junit.xml" ]; then
    "$PY" .ci/gpu/junit_table.py "$OUT/junit.xml"
  elif [ -f "$OUT/tests.log" ]; then # killed before pytest wrote its XML: its last count
    grep -E '(passed|failed|skipped|error|no tests ran)' "$OUT/tests.log" | tail -1
  fi
} | tee "$OUT/summary.txt"
exit "$FAILED"
