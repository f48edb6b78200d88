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

.PHONY: run test test-quick test-gpu test-container image bench install clean

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

# NumPy asks the kernel for huge pages on every large array (madvise). Where the page cache has filled the
# memory, as it has after an install and a few tests, each asks for compaction first: touching a fresh
# 411 MB array took 3.5 to 4.4 s with it, 0.2 s without (DEVELOPERS.md, "Huge pages"). The tests check
# behaviour, not the memory policy, so they run without; `make run` keeps NumPy's default.
TEST_ENV := NUMPY_MADVISE_HUGEPAGE=0

# The whole suite, as CI runs it. The 25 slowest tests close the output: CI must stay under 40 minutes on
# its slowest machine (AMD Zen 3, 2 vCPU), and this shows where it goes.
test: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q --durations=25

# The quick tier, for developers: the suite without the tests marked `slow` (the kit's full runs and the long
# end-to-end tests, DEVELOPERS.md "Test tiers"), under 10 minutes on 2 cores. `make test` runs them all.
test-quick: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q -m 'not gpu and not container and not slow' --durations=10

# The GPU tier, on a CUDA machine: the tests marked `gpu`, then the kit at every declared precision for
# every backend that sees the accelerator. It runs in the current Python environment (no .venv, no
# install: the CUDA machines cannot download) and fails when no accelerator is visible.
test-gpu:
	$(PYTHON) tests/gpu_tier.py

# The aiperf image (Containerfile), built without network from wheels this venv's pip gathers
# (tools/build_image.sh, docs/deploy.md): IMAGE_EXTRAS are aiperf's extras (add torch, jax, ... for a
# backend; the NumPy one is always in), IMAGE_MOUNTS the mount points a centre's filesystems need.
IMAGE_EXTRAS ?= search
IMAGE_NAME   ?= aiperf
IMAGE_OUT    ?= build/image
IMAGE_MOUNTS ?=
image: $(BIN)/python
	EXTRAS="$(IMAGE_EXTRAS)" IMAGE_NAME="$(IMAGE_NAME)" OUT="$(IMAGE_OUT)" MOUNTS="$(IMAGE_MOUNTS)" \
	  PYTHON=$(BIN)/python tools/build_image.sh

# Builds the NumPy image (make image: about 2 minutes, 45 s where build/image/base.tar was made before)
# and runs replicas in it, locally and on the test SLURM cluster (about 3.5 minutes in all): too slow for
# `make test`, which checks the wrapping and the refusals without an image (tests/test_container.py).
# As root it apt-installs Charliecloud, python3-lark and mmdebstrap.
test-container: $(STAMP)
	$(BIN)/python -m pytest -q -m container tests/test_container_image.py

# Every script in benchmarks/ (about 50 min on 2 cores: 35 before the LM scripts, lm_memory.py 12 of the rest), or BENCH="name ...", then one table.
bench: $(STAMP)
	$(BIN)/python benchmarks/_suite.py $(BENCH)

clean:
	rm -rf $(VENV) build *.egg-info
