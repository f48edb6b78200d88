# `make run` and `make test` work on a fresh clone: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
# What `make test` exercises: test tools, ONNX, search, and every backend the kit runs on.
EXTRAS ?= dev,torch,tensorflow,jax,mindspore,dali
PLUGINS := plugins/aiperf-numpy
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: run test test-gpu bench install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt $(PLUGINS)/pyproject.toml
	$(PIP) -e ".[$(EXTRAS)]"
	$(PIP) --no-deps $(foreach p,$(PLUGINS),-e $(p))
	@touch $@

install: $(STAMP)

# A real 5-minute run of the whole benchmark on the embedded digits dataset (see examples/quick.toml).
run: $(STAMP)
	$(BIN)/aiperf run --config examples/quick.toml

# The 25 slowest tests close the output: CI must stay under 30 minutes, and this shows where it goes.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

# The GPU tier, on a CUDA machine: the tests marked `gpu`, then the kit at every declared precision for
# every backend that sees the accelerator. It runs in the current Python environment (no .venv, no
# install: the CUDA machines cannot download) and fails when no accelerator is visible.
test-gpu:
	$(PYTHON) tests/gpu_tier.py

# Every script in benchmarks/ (about 50 min on 2 cores: 35 before the LM scripts, lm_memory.py 12 of the rest), or BENCH="name ...", then one table.
bench: $(STAMP)
	$(BIN)/python benchmarks/_suite.py $(BENCH)

clean:
	rm -rf $(VENV) build *.egg-info
