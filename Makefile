# The README's two commands: `make demo` (end to end on a real Wikipedia sample) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch comes from when the venv has none in the project's range: a URL, or `default` for
# pip's own indexes. Unset: PyTorch's CPU index without an NVIDIA GPU, pip's default with one
# (tools/setup_torch.py). E.g. `make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126`.
TORCH_INDEX ?=
export TORCH_INDEX
# The tested versions (constraints.txt); `make setup CONSTRAINTS=` lets pip resolve afresh.
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: setup test test-fast test-gpu demo clean rehearse-gpu science-data constraints

setup: $(STAMP)

# The editable install is setuptools' strict mode: a tree of links (build/__editable__.*) that
# static readers (pyright, mypy, an IDE) follow, as they do not run import hooks. It links the
# files present at install time, so a module added or removed re-runs the install: MODULES
# changes only when the list of package files does.
MODULES := $(VENV)/.modules
$(MODULES): FORCE
	@mkdir -p $(VENV)
	@find shatter pipeline train tools -name '*.py' -not -path '*/__pycache__/*' | sort > $@.new
	@cmp -s $@.new $@ && rm $@.new || mv $@.new $@

.PHONY: FORCE

# Idempotent: re-runs only when the package metadata changes. torch is installed first (or an
# installed one in the project's range kept), so pip never resolves the range to a multi-GB CUDA
# build on a CPU machine. DeepSpeed's CPU comm op is JIT-built once here rather than in the first
# run or test. Every step prints what it does (pip's own progress included).
$(STAMP): setup.cfg setup.py pyproject.toml $(CONSTRAINTS) $(MODULES)
	@test -x $(PY) || { echo "==> creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@$(PY) tools/setup_torch.py
	@echo "==> installing shatter and its extras at the tested versions ($(or $(CONSTRAINTS),unpinned))"
	$(PY) -m pip install $(PIN) --config-settings editable_mode=strict -e \
		'.[pipeline,train,test,demo,pipeline-dask,pipeline-hf,s3]'
	@echo "==> DeepSpeed's CPU communication op: built here, once per torch build, not in the first launch"
	$(PY) -c "from shatter.train.engine import build_extensions; build_extensions()"
	@touch $(STAMP)
	@echo "==> set-up done: $(VENV) ($$($(PY) -c 'import torch; print("torch", torch.__version__)'))"

# The suite in WORKERS pytest-xdist processes, a test module at a time to each (--dist
# loadscope): a module's tests share its module fixtures (its launches), made once. (loadgroup's
# xdist_group marks are lost under pytest 9.2: pytest-xdist 3.8 renames a test by its _nodeid,
# which pytest 9 no longer reads.) test-fast leaves out the tests marked slow, those of more than
# a few seconds.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadscope

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/basedpyright --pythonpath $(PY)
	$(PY) -m pytest -q $(XDIST)

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow and not gpu"

# The tests marked gpu: the compiled Triton kernels against the references, and the GPU lane of
# the real CLIs on one CUDA device (tests/train/test_gpu.py, tests/finetune/test_gpu.py); they
# skip without CUDA.
test-gpu: setup
	$(PY) -m pytest -q -m gpu -s

# The GPU lane (.ci/gpu/run.sh) rehearsed on this CPU machine in an interpreter like the GPU
# image's: every call, where what could fail is not the GPU (docs/internals/gpu-runbook.md).
rehearse-gpu:
	bash .ci/gpu/run.sh rehearse

# The science call's dataset, carried to the GPU machine in .science/ (docs/results.md).
science-data: setup
	$(PY) tools/science_data.py

demo: setup
	$(PY) tools/demo.py

# Rewrite constraints.txt from the venv after a green `make test` with new versions.
constraints: setup
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -viE '^(torch|shatter)'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
