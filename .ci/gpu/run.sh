#!/usr/bin/env bash
# The GPU lane and the GPU figures, one call of a GPU machine without network access at a time
# (docs/internals/gpu-runbook.md). From the repository root, with .whl/ built by
# .ci/gpu/wheels.sh beside it:
#
#   bash .ci/gpu/run.sh CALL [pytest arguments...]
#
# Each CALL fits one 10-minute call: its steps' time boxes add up to at most 540 s.
#   kernels   the compiled kernels against the references: the paper's base shape first, then
#             every other `gpu` kernel test (inductor's LayerNorm gradients finished by ours
#             among them), in parallel (pytest-xdist); then the FFN's GEMMs
#             with GELU in their epilogues timed against cuBLAS and GELU (bench_ffn.py), and the
#             one-pass optimizer step against DeepSpeed's with torch's AdamW (bench_optim.py)
#   bench     tools/bench/bench_kernel.py, then the whole-step benchmarks bench_model and bench_train
#   jobs      the DeepSpeed and finetuning jobs of tests/train/test_gpu.py and
#             tests/finetune/test_gpu.py (the V100 path among them), in parallel
#   host      where a step's wall time goes: tools/bench/host_profile.py's bare step (eager
#             against a replayed CUDA graph, and Shatter compiled with inductor's CUDA graphs)
#             and the `triton` attention's host cost and kernels, then bench_train's (compiled)
#             trainer against its bare step, under py-spy (wheels.sh brings
#             it; the raw stacks come back gzipped)
#   measure   tools/bench/step_measure.py: the step of bert and shatter at l = 256 and 1024, eager
#             and compiled, beside step_cost.py's model of it (runs/modelled.json, made here by
#             `step_cost.py --gpus H100,H200 --json runs/modelled.json` and carried), with the
#             profiler's split; then tools/bench/launch_cost.py (the host's µs per Triton launch,
#             Triton's path against shatter.kernels.launch's) and bench_train's trainer against
#             its bare step
#   science   tools/reproduce.py science --scale gpu-small on the carried dataset .science/
#             (make science-data): bert-small against shatter-small, extended to twice the length
#   all       (the default) the base-shape kernels, the three benchmarks, the jobs: 9 minutes
#   rehearse  the whole lane on this CPU machine in an environment like the GPU image's
#             (.ci/gpu/rehearse_env.sh): every call whose steps mean something without a GPU
#
# Every call starts with `env`: .whl/*.whl installed into /tmp/site, which every interpreter
# the lane starts sees (PYTHONPATH, and a .pth file in the interpreter's site directory), the
# checkout installed (editable: `shatter.pipeline` is pipeline/, setup.py), the console scripts
# the tests call put beside the interpreter, the GPU and versions printed.
# A step runs in a time box; when it is up, the step's processes end, those in sessions of their
# own included (each carries LANE_STEP in its environment), before the next step starts. Pytest
# steps give each test a timeout below the box. $OUT (runs/gpu/CALL/ by default) gets one log
# per step and summary.txt (each step's exit status and seconds, the tests' table): at most 8
# files. GPU_DRY=1 lists the steps and their boxes without running them. PYTHON (python3) is
# the interpreter; GPU_SCALE multiplies every box (the rehearsal's CPU is slower).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
MODE=${1:-all}
[ $# -gt 0 ] && shift
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/runs/gpu/$MODE}
BUDGET=${GPU_BUDGET:-570}
DRY=${GPU_DRY:-0}
SITE=${GPU_SITE:-/tmp/site}
SCALE=${GPU_SCALE:-1}
REHEARSE=${GPU_REHEARSE:-0}
# Each call: its steps, each `name:box` in seconds, run in this order.
case $MODE in
  kernels) PLAN="env:90 kernel_base:120 kernels:280 bench_ffn:30 bench_optim:20" ;;
  bench) PLAN="env:90 bench_kernel:160 bench_model:130 bench_train:160" ;;
  jobs) PLAN="env:90 jobs:450" ;;
  science) PLAN="env:90 science:450" ;;
  host) PLAN="env:90 host_step:150 host_op:80 host_train:220" ;;
  measure) PLAN="env:90 measure:300 launch:30 trainer:120" ;;
  all) PLAN="env:90 kernel_base:80 bench_kernel:90 bench_model:70 bench_train:70 jobs:140" ;;
  rehearse) exec bash .ci/gpu/rehearse.sh "$@" ;;
  --env-step) ;;
  *) echo "run.sh: error: unknown call '$MODE' (kernels, bench, jobs, science, host, measure, all or rehearse) in $0" >&2; exit 2 ;;
esac
((REHEARSE)) && [ "$MODE" = kernels ] && PLAN="$PLAN kernel_report:200"
if [ "$MODE" != --env-step ]; then # this call's files only: an earlier call's are not counted
  mkdir -p "$OUT" || { echo "run.sh: error: cannot create $OUT (OUT)" >&2; exit 1; }
  rm -f "$OUT"/*.log "$OUT"/summary.txt "$OUT"/science.md "$OUT"/science.png
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${SHATTER_SHARED_DATA:-}" ] && [ -d .whl/data ]; then
  export SHATTER_SHARED_DATA="$PWD/.whl/data"
fi
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
SUMMARY=()
FAILED=0

box() { # the box of step $1 in this call's plan, scaled
  local item
  for item in $PLAN; do
    [ "${item%%:*}" = "$1" ] && awk "BEGIN {print int(${item#*:} * $SCALE)}"
  done
}

# Every process whose environment holds LANE_STEP=$1: a step's leftovers, in any session.
sweep() {
  local pid found=()
  for pid in $(grep -lzsx "LANE_STEP=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
    [ "$pid" != $$ ] && found+=("$pid")
  done
  ((${#found[@]})) || return 0
  echo "run.sh: ending ${#found[@]} process(es) step $1 left running: ${found[*]}"
  kill -KILL "${found[@]}" 2>/dev/null
  sleep 2
}

# step NAME COMMAND...: COMMAND in NAME's box (its own process group; SIGINT first, as Ctrl-C,
# so that pytest still writes its XML), output to $OUT/NAME.log.
step() {
  local name=$1 limit left log=$OUT/$1.log t0 rc tag
  shift
  limit=$(box "$name")
  left=$((BUDGET - SECONDS - 15))
  ((limit > left)) && limit=$left
  if ((limit < 30)); then
    SUMMARY+=("$name: skipped, $left s left of GPU_BUDGET=$BUDGET")
    return
  fi
  echo "+ [$limit s] $*" | tee "$log"
  if [ "$DRY" = 1 ]; then
    SUMMARY+=("$name: dry run, box $limit s")
    return
  fi
  tag="$name-$$-$RANDOM"
  t0=$SECONDS
  LANE_STEP=$tag timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  sweep "$tag" | tee -a "$log"
  ((rc == 124 || rc == 137)) && rc="$rc (timed out after $limit s)"
  [ "$rc" = 0 ] || FAILED=1
  SUMMARY+=("$name: exit $rc, $((SECONDS - t0)) s, $log")
}

# pytest NAME PER_TEST WORKERS ARGS...: a pytest step, each test in PER_TEST seconds (below the
# box), WORKERS parallel pytest-xdist processes (0: none), the XML kept for the summary.
pytest_step() {
  local name=$1 per_test=$2 workers=$3 parallel=() pre=()
  shift 3
  ((workers > 0)) && parallel=(-n "$workers")
  [[ $name == kernel* ]] && pre=("${KERNEL_ENV[@]}")
  per_test=$(awk "BEGIN {t = int($per_test * $SCALE); b = $(box "$name") - 20; print (t < b ? t : b)}")
  step "$name" "${pre[@]}" "$PY" -m pytest -q -s -p no:cacheprovider "${parallel[@]}" --timeout "$per_test" \
    --junitxml "$SCRATCH/$name.xml" -o junit_family=xunit1 "$@"
}

# spied NAME COMMAND...: step NAME, under py-spy (its raw stacks, gzipped, to $OUT/NAME.spy.gz)
# where it is installed (wheels.sh brings it); else the command alone.
spied() {
  local name=$1 spy
  shift
  spy="$(dirname "$(command -v "$PY")")/py-spy" # beside the interpreter (the env step's scripts)
  [ -x "$spy" ] || spy=$(command -v py-spy || true)
  if [ -z "$spy" ] || [ "$DRY" = 1 ]; then
    step "$name" "$@"
    return
  fi
  step "$name" "$spy" record -r 100 --idle --threads -f raw -o "$SCRATCH/$name.spy" -- "$@"
  [ -f "$SCRATCH/$name.spy" ] && gzip -c "$SCRATCH/$name.spy" >"$OUT/$name.spy.gz"
}

# The wheels are CPython 3.12 x86-64 builds: another interpreter keeps its own packages.
install_wheels() {
  local tag
  tag=$("$PY" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "run.sh: no .whl/*.whl (bash .ci/gpu/wheels.sh builds them): using $PY's own packages"
  elif [ "$tag" != cp312-x86_64 ]; then
    echo "run.sh: $PY is $tag, the wheels are cp312-x86_64: using its own packages"
  elif [ "$(cat "$SITE/.lane-wheels" 2>/dev/null)" = "$(wheel_list)" ]; then
    echo "run.sh: $SITE holds .whl/ already (a warm machine's earlier call)"
    site_pth || return 1
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || return 1
    wheel_list >"$SITE/.lane-wheels"
    site_pth || return 1
  fi
  install_checkout || return 1
  scripts
}

# The checkout as the package `shatter` (shatter/pipeline, shatter/train and shatter/tools are
# links to the checkout's folders: setup.py), editable so the lane runs this tree's code. Built
# by the interpreter's own setuptools; nothing is fetched.
install_checkout() {
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . || {
    echo "run.sh: error: installing the checkout (pip install -e .) failed: $PY needs setuptools >= 64" >&2
    return 1
  }
  echo "run.sh: installed the checkout $PWD into $PY (editable)"
}

wheel_list() { (cd .whl && ls -l -- *.whl | sha256sum); }

# /tmp/site for every interpreter started from $PY, whatever PYTHONPATH it is given: a .pth
# file in $PY's site directory adds it as a site directory (its own .pth files processed too).
site_pth() {
  "$PY" - "$SITE" <<'EOF'
import os, site, sys, sysconfig
path = os.path.join(sysconfig.get_paths()["purelib"], "shatter-gpu-lane.pth")
with open(path, "w") as f:
    f.write(f"import site; site.addsitedir({sys.argv[1]!r})\n")
print(f"run.sh: wrote {path}: {sys.argv[1]} on every {sys.executable}'s path")
EOF
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
  # the imports again in a child whose PYTHONPATH holds the checkout alone: the .pth file's work
  PYTHONPATH=$PWD "$PY" .ci/gpu/env_report.py || return 1
  "$PY" -m pip check || true
}

if [ "$MODE" = --env-step ]; then # the env step itself, in its own process under timeout
  install_wheels
  exit
fi

# What each step runs; on a CPU (the rehearsal) the benchmarks take their CPU sizes.
# The rehearsal runs the kernel tests under Triton's interpreter, which in Triton 3.6 (the image's)
# takes int() of 1-element arrays, an error from numpy 2.4 on: there they get the numpy<2.4 that
# .ci/gpu/rehearse_env.sh puts in GPU_REHEARSE_NUMPY (the GPU's compiled kernels never meet it).
KERNEL_ENV=()
[ -n "${GPU_REHEARSE_NUMPY:-}" ] && KERNEL_ENV=(env "PYTHONPATH=$GPU_REHEARSE_NUMPY:$PYTHONPATH")
DEVICE=cuda BENCH_SIZE=base BENCH_STEPS=20 JOB_WORKERS=4 KERNEL_WORKERS=8
MODEL_ARGS=(--lengths 512,1024,2048 --batch-tokens 16384)
HOST_ARGS=(--size base --compile shatter)
MEASURE_ARGS=(--json "$OUT/measured.json")
TRAINER_ARGS=(--sizes base --micro-batch 64 --steps 10)
JOBS=(tests/train/test_gpu.py tests/finetune/test_gpu.py)
if ((REHEARSE)); then
  DEVICE=cpu BENCH_SIZE=tiny BENCH_STEPS=2 JOB_WORKERS=2 KERNEL_WORKERS=2
  MODEL_ARGS=(--size tiny --lengths 128 --batch-tokens 512 --repeats 1)
  HOST_ARGS=(--size tiny --micro-batch 2 --seq-len 64 --steps 2 --compile shatter)
  MEASURE_ARGS+=(--device cpu --size tiny --tokens 256 --lengths 64 --steps 2 --warmup 2)
  TRAINER_ARGS=(--sizes tiny --micro-batch 2 --steps 2)
  # one case of each job test: what the rehearsal checks is the lane's environment (imports,
  # console scripts, launchers, paths); the CPU suite covers every ZeRO stage on CPU ranks
  JOBS=(-k "not (memory and (bf16-0 or bf16-1 or bf16-2)) and not zero_0_1_3[0] and not zero_0_1_3[3]"
    "${JOBS[@]}")
fi
# each model's time box: 180 s of the science step's 450 (two models, then 3 extensions and 5
# evaluations of seconds each)
SCIENCE_ARGS=(--scale gpu-small --data .science/l128 --output "$SCRATCH/science"
  --budget-seconds "$(awk "BEGIN {print int(180 * $SCALE)}")")
((REHEARSE)) && SCIENCE_ARGS+=(--steps 6 --eval-every 3 --config .ci/gpu/science-cpu.yaml)
for item in $PLAN; do
  case ${item%%:*} in
    env) step env bash "$0" --env-step ;;
    kernel_base) pytest_step kernel_base 100 3 -m gpu \
      tests/shatter/test_triton_kernel.py -k base_shape "$@" ;;
    kernels) pytest_step kernels 150 "$KERNEL_WORKERS" -m gpu tests/shatter tests/train/test_mix_order.py \
      -k "not base_shape" "$@" ;;
    kernel_report) step kernel_report "$PY" tools/bench/kernel_report.py --arch 80,90 --shape base \
      --dtype bf16 --length 509 ;;
    bench_ffn) if [ "$DEVICE" = cuda ]; then
      step bench_ffn "$PY" tools/bench/bench_ffn.py --tokens 16384 --dtype bf16 --shape base
    else SUMMARY+=("bench_ffn: not rehearsed (it times CUDA kernels)"); fi ;;
    bench_optim) if [ "$DEVICE" = cuda ]; then
      step bench_optim "$PY" tools/bench/bench_optim.py --preset bert-base
    else SUMMARY+=("bench_optim: not rehearsed (it times CUDA kernels)"); fi ;;
    bench_kernel) if [ "$DEVICE" = cuda ]; then
      step bench_kernel "$PY" tools/bench/bench_kernel.py --lengths 128,256,512,1024 --dtype bf16
    else SUMMARY+=("bench_kernel: not rehearsed (it times CUDA kernels)"); fi ;;
    bench_model) step bench_model "$PY" tools/bench/bench_model.py --device "$DEVICE" "${MODEL_ARGS[@]}" \
      --markdown ;;
    bench_train) step bench_train "$PY" tools/bench/bench_train.py --device "$DEVICE" --precision bf16 \
      --vs-bare --sizes "$BENCH_SIZE" --archs bert,shatter,bert-rpe,bert-rab --steps "$BENCH_STEPS" ;;
    host_step) step host_step "$PY" tools/bench/host_profile.py step --device "$DEVICE" "${HOST_ARGS[@]}" ;;
    host_op) if [ "$DEVICE" = cuda ]; then
      spied host_op "$PY" tools/bench/host_profile.py op --loop-seconds 6
    else SUMMARY+=("host_op: not rehearsed (it times CUDA kernels)"); fi ;;
    host_train) spied host_train "$PY" tools/bench/bench_train.py --device "$DEVICE" --precision bf16 \
      --vs-bare --sizes "$BENCH_SIZE" --archs bert,shatter --micro-batch 64 --steps "$BENCH_STEPS" ;;
    measure) step measure "$PY" tools/bench/step_measure.py "${MEASURE_ARGS[@]}" \
      $([ -f runs/modelled.json ] && echo --modelled runs/modelled.json) ;;
    launch) step launch "$PY" tools/bench/launch_cost.py --rows 4 --calls 500 ;;
    trainer) step trainer "$PY" tools/bench/bench_train.py --device "$DEVICE" --precision bf16 \
      --vs-bare --archs bert,shatter "${TRAINER_ARGS[@]}" ;;
    jobs) pytest_step jobs 150 "$JOB_WORKERS" -m gpu "${JOBS[@]}" "$@" ;;
    science) if [ -f .science/l128/index.json ] || [ "$DRY" = 1 ]; then
      step science "$PY" tools/reproduce.py science "${SCIENCE_ARGS[@]}"
      cp "$SCRATCH"/science/science.{md,png} "$OUT"/ 2>/dev/null
    else
      SUMMARY+=("science: error: no .science/l128 (make science-data here; carry .science)")
      FAILED=1
    fi ;;
  esac
done

{
  total=0
  for item in $PLAN; do total=$((total + $(box "${item%%:*}"))); done
  echo "run.sh $MODE: $SECONDS s of GPU_BUDGET=$BUDGET; the steps' boxes add up to $total s"
  grep -hE '^(NVIDIA|GPU 0|torch |Python )' "$OUT/env.log" 2>/dev/null
  printf '%s\n' "${SUMMARY[@]}"
  for xml in "$SCRATCH"/*.xml; do
    [ -f "$xml" ] || continue
    echo "$(basename "$xml" .xml):"
    "$PY" .ci/gpu/junit_table.py "$xml"
  done
  n=$(find "$OUT" -type f | wc -l)
  if ((n > 8)); then
    echo "run.sh: error: $OUT holds $n files, a call brings back 8: fewer steps or files per call"
    exit 1
  fi
} | tee "$OUT/summary.txt"
((PIPESTATUS[0])) && FAILED=1
exit "$FAILED"
