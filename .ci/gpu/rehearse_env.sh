#!/usr/bin/env bash
# An interpreter like the GPU image's, on a CPU machine with the package index: CPython 3.12
# (pyenv's, or python3.12 on PATH) in a venv holding what the image holds of what the lane uses:
# the image's packages that the project's requirements reach (.whl/image.txt, written by
# .ci/gpu/wheels.sh: torch 2.11.0, Triton 3.6.0, numpy 2.5.2 ... at the image's versions where
# they are known, the others at most at the releases the resolver chose beside the carried
# packages) and the test tools, matplotlib and transformers 5.17.0 the image has. torch is PyPI's 2.11.0, the image's own build (CUDA 13.0): it
# runs on a CPU, and no CPU build of torch for CPython 3.12 is on the index this machine
# reaches. Nothing the lane carries (.whl/) goes in: run.sh installs that into /tmp/site, as on
# the GPU machine. Kept between runs under GPU_REHEARSE_VENV, rebuilt when its list changes.
# Prints the interpreter's path last.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${GPU_REHEARSE_VENV:-$HOME/.cache/shatter/gpu-rehearse-py312}
# beside the requirements' share of the image: its test tools, plot library and Hugging Face
# stack (the export's parity tests), at the image's versions where they are known
TOOLS=(pytest pytest-xdist pytest-timeout matplotlib transformers==5.17.0 tokenizers==0.23.2
  accelerate==1.15.0 'setuptools>=64' wheel)
[ -f .whl/image.txt ] || { echo "rehearse_env.sh: error: no .whl/image.txt (bash .ci/gpu/wheels.sh writes it)" >&2; exit 1; }
INTERPRETER_NUMPY='numpy<2.4'
want=$( (cat .whl/image.txt; printf '%s\n' "${TOOLS[@]}" "$INTERPRETER_NUMPY") | sort | sha256sum | cut -c1-16)
if [ -f "$VENV/.rehearse-$want" ] && "$VENV/bin/python" -c 'import torch, triton' 2>/dev/null; then
  echo "rehearse_env.sh: $VENV is up to date" >&2
  echo "$VENV/bin/python"
  exit 0
fi
# pyenv's newest 3.12, else python3.12 on PATH (a pyenv shim there may not run: each is tried)
base=
for c in $(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r) \
  $(command -v python3.12); do
  "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && base=$c && break
done
[ -n "$base" ] || { echo "rehearse_env.sh: error: no Python 3.12 (pyenv install 3.12, or python3.12 on PATH)" >&2; exit 1; }
echo "rehearse_env.sh: building $VENV from $base (torch's CUDA build: about 5 GB, a few minutes)" >&2
rm -rf "$VENV"
"$base" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# torch first at the image's version: the image list's numpy, transformers ... then find it there
"$VENV/bin/python" -m pip install -q -r .whl/image.txt "${TOOLS[@]}" >&2
# Triton 3.6's interpreter (the kernel tests on a CPU) fails under numpy >= 2.4: run.sh puts this
# numpy ahead for those tests alone (GPU_REHEARSE_NUMPY)
"$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/interpreter-numpy" "$INTERPRETER_NUMPY" >&2
touch "$VENV/.rehearse-$want"
echo "$VENV/bin/python"
