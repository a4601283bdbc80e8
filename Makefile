# The README's two commands: `make demo` (end to end on a real Wikipedia sample) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-gpu demo bench clean

setup: $(STAMP)

# Idempotent: re-runs only when the package metadata changes. torch is pinned to the CPU wheel
# first, so the project's torch range is already satisfied and pip never pulls a CUDA build.
# DeepSpeed's CPU comm op is JIT-built once here rather than in the first run or test.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e '.[train,test,demo,pipeline-dask,s3]'
	$(PY) -c "from train.engine import build_extensions; build_extensions()"
	touch $(STAMP)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

# The tests marked gpu: the compiled Triton kernels against the references, and the GPU lane of
# the real CLIs on one CUDA device (tests/train/test_gpu.py, tests/finetune/test_gpu.py); they
# skip without CUDA.
test-gpu: setup
	$(PY) -m pytest -q -m gpu -s

demo: setup
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
