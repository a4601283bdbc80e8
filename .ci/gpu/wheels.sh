#!/usr/bin/env bash
# Fill .whl/ (git-ignored) on a connected machine with what the GPU lane (.ci/gpu/run.sh) installs
# on a GPU machine without network access: CPython 3.12, x86-64 manylinux wheels of the project's
# install_requires and `train` extra with everything they need, minus the packages that the GPU
# machine's Python already has (IMAGE below), so nothing shadows its torch, numpy or pyarrow.
# One version of each package. With SHATTER_SHARED_DATA set, its books/ (the sample text the
# GPU tests build datasets from) goes along in .whl/data/.
#
#   bash .ci/gpu/wheels.sh          # PYTHON=python3 by default; needs pip >= 23 and the index
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=.whl
# Pins: the releases the CPU suite runs. DeepSpeed ships an sdist only: its pure wheel is built.
DEEPSPEED=deepspeed==0.19.8
# py-spy: the `host` call samples the trainer's host stacks with it
PINS=(apache-beam==2.77.0 "$DEEPSPEED" py-spy==0.4.3)
# The GPU machine's Python packages (pip names), as its image lists them.
IMAGE=(
  absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
  build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
  cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
  einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
  gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
  iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
  kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
  markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
  multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
  numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
  nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
  nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
  nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
  opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
  pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
  pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
  pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
  rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
  sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
  statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
  tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
  torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
  typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
)
# The image's versions where they are known: a carried wheel that asks for another is reported.
KNOWN=(numpy==2.5.2 torch==2.11.0 triton==3.6.0 huggingface-hub==1.33.0 safetensors==0.8.0
  sentencepiece==0.2.2 tokenizers==0.23.2 transformers==5.17.0 accelerate==1.15.0)
TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312)
for n in $(seq 5 39); do TAGS+=(--platform "manylinux_2_${n}_x86_64"); done
TAGS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
helper() { "$PYTHON" .ci/gpu/wheelset.py "$@"; }
printf '%s\n' "${IMAGE[@]}" >"$work/image.txt"
printf '%s\n' "${PINS[@]}" >"$work/pins.txt"
helper requirements >"$work/requirements.txt"

echo "wheels.sh: building DeepSpeed's pure wheel"
"$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$work/built" "$DEEPSPEED"
echo "wheels.sh: resolving $(wc -l <"$work/requirements.txt") requirements for CPython 3.12 x86-64 (metadata only, a few minutes)"
"$PYTHON" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" \
  --target "$work/target" "${TAGS[@]}" --find-links "$work/built" \
  -r "$work/requirements.txt" -c "$work/pins.txt"
helper select "$work/report.json" "$work/image.txt" >"$work/carry.txt"

rm -rf "$DEST"
mkdir -p "$DEST"
echo "wheels.sh: downloading $(wc -l <"$work/carry.txt") wheels"
"$PYTHON" -m pip download -q --no-deps "${TAGS[@]}" --find-links "$work/built" -d "$DEST" \
  -r "$work/carry.txt"

# Complete: pip resolves the requirements from .whl/ and empty stand-ins for the image's
# packages alone (no index, no config), at the versions the resolver chose for them.
helper stubs "$work/report.json" "$work/image.txt" "$work/stubs"
PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip --isolated install -q --dry-run --ignore-installed --no-index \
  --target "$work/verify" "${TAGS[@]}" --find-links "$DEST" --find-links "$work/stubs" \
  -r "$work/requirements.txt" -c "$work/pins.txt" ||
  { echo "wheels.sh: error: $DEST/ plus the image does not satisfy setup.cfg's requirements" >&2; exit 1; }
helper check "$DEST" "$work/image.txt" "${KNOWN[@]}"
# The image's packages the requirements use, pinned: .ci/gpu/rehearse_env.sh installs them.
helper image "$work/report.json" "$work/image.txt" "${KNOWN[@]}" >"$DEST/image.txt"
have=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
want=$(wc -l <"$work/carry.txt")
[ "$have" -eq "$want" ] ||
  { echo "wheels.sh: error: $DEST/ holds $have wheels, $want were selected" >&2; exit 1; }

if [ -n "${SHATTER_SHARED_DATA:-}" ]; then
  [ -d "$SHATTER_SHARED_DATA/books" ] ||
    { echo "wheels.sh: error: $SHATTER_SHARED_DATA/books not found (SHATTER_SHARED_DATA)" >&2; exit 1; }
  mkdir -p "$DEST/data"
  cp -r "$SHATTER_SHARED_DATA/books" "$DEST/data/"
  chmod -R u+w "$DEST/data"
else
  echo "wheels.sh: SHATTER_SHARED_DATA unset: no sample data in $DEST/data, the GPU tests that need it will skip"
fi

sort "$work/carry.txt" | tr '\n' ' '
echo
wheel_mb=$(du -cb "$DEST" | tail -1 | awk '{printf "%.1f", $1 / 1048576}')
repo_mb=$(git ls-files -z | xargs -0 du -cb | awk '/total$/ {s += $1} END {printf "%.1f", s / 1048576}')
echo "wheels.sh: $want wheels, $DEST/ is $wheel_mb MiB; with the tracked files ($repo_mb MiB) $(awk "BEGIN {print $wheel_mb + $repo_mb}") MiB"
awk "BEGIN {exit !($wheel_mb + $repo_mb < 60)}" ||
  { echo "wheels.sh: error: $DEST/ and the repository exceed 60 MiB" >&2; exit 1; }
