# Two commands do all set-up on a fresh machine:
#   make demo   -- create .venv, install seqpar, run the main job on its embedded default
#   make test   -- create .venv, install seqpar with dev tools, lint and run the test suite
# Both install the extras the tests and the demo use (plots, progress bar, Hugging Face interop, data:
# tokenizers and datasets for seqpar prepare):
# every test runs, none is skipped for a missing package. The demo adds TensorBoard.
# TORCH_SPEC pins the CPU build that lies on this machine's disk; on a GPU machine use e.g.
#   make test TORCH_SPEC='torch>=2.11,<2.15'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,interop,plots,progress,data
PY := $(VENV)/bin/python

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# the demo also logs to TensorBoard (OUT/tensorboard; `tensorboard --logdir runs/demo/tensorboard`)
$(VENV)/.demo-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[tensorboard]'
	touch $@

# --overwrite: each `make demo` starts the demo run afresh in runs/demo
demo: $(VENV)/.demo-installed
	$(PY) -m seqpar train --config configs/default.toml --nproc 2 --overwrite

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check seqpar tests benchmarks

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
