# `make quickstart` and `make test` each create .venv and install jaxlm into it on first use.
# quickstart installs the package alone; test adds the test tools, the `tpu` extra (libtpu, so that train steps
# compile for TPU topologies on this CPU host) and the `hf` extra (transformers and a CPU build of torch) for
# the Hugging Face parity tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest workers for `make test` and `make test-all` (pytest-xdist): the suite is compile-bound, and two workers
# keep both cores of a 2-core machine busy. TEST_WORKERS=0 runs it without workers.
TEST_WORKERS ?= 2
# XLA:CPU mallocs a large scratch buffer every step; transparent huge pages avoid most of its page faults
# (the jaxlm command sets this itself; scripts and tests started from here get it too).
export GLIBC_TUNABLES := glibc.malloc.hugetlb=1

.PHONY: quickstart test test-all test-tpu bench clean slurm browser

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# torchvision (the Llama 4 image processor the vision parity test compares with): the package index holds its CUDA
# build alone, whose compiled ops do not load beside the CPU torch and whose import then fails; it goes into a folder
# of its own that only the pytest process puts on its path (tests/conftest.py), so the venv's other programs
# (benchmarks, transformers' text models) never import it.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,hf,tpu]"
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/torchvision-for-tests torchvision==0.28.0
	touch $@

# tests/test_slurm.py starts a real Slurm cluster (slurmctld and two slurmd on this machine, with munge): Debian's
# slurm-wlm and munge, installed here when missing (as root, as CI runs; elsewhere the Slurm tests say what is missing).
slurm:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
	{ export DEBIAN_FRONTEND=noninteractive; apt-get update -qq >/dev/null && \
	  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } || \
	echo "make slurm: could not install slurm-wlm and munge (needs root and apt); the Slurm tests will fail"

# tests/test_serve_page.py drives the chat page of `jaxlm serve` in a real headless Chromium: Debian's chromium and
# chromium-driver (selenium, in the dev extra, drives them), and socat, which forwards a TCP port to serve.uds's socket
# as `jaxlm serve` prints; installed here when missing (as root, as CI runs; elsewhere the browser test says what is
# missing).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v socat >/dev/null || \
	{ export DEBIAN_FRONTEND=noninteractive; apt-get update -qq >/dev/null && \
	  apt-get install -y -qq --no-install-recommends chromium chromium-driver socat >/dev/null 2>&1; } || \
	echo "make browser: could not install chromium, chromium-driver and socat (needs root and apt); the browser test will fail"

quickstart: $(VENV)/.installed
	$(VENV)/bin/jaxlm train quickstart

# `make test` (CI's command) runs every test not marked `slow`, and the slow ones marked `in_ci` (the Slurm jobs,
# the GPU benchmark at tiny sizes, a 20 s soak of the server, one pipeline, expert and context-parallel
# equivalence run); `make test-all` runs the whole slow tier too: every family and layout of the equivalence runs,
# the multi-process and emulator runs and the benchmark scripts at tiny sizes (README, Tests). Each module runs on
# one worker (`--dist loadfile`: a module-scoped fixture trains or starts its server once), in the order
# tests/conftest.py gives (`--no-loadscope-reorder`: the longest modules first, not the ones with the most tests).
# A worker that dies has its test reported failed and the run stops there, the tests left unrun
# (`--max-worker-restart=0`): pytest-xdist 3.8's loadfile scheduler, replacing it, can hand the new worker work it
# never starts and wait for it until CI's time limit. (Workers died of a segmentation fault in XLA while they
# kept every module's programs: tests/conftest.py clears JAX's caches after each module.)
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0 \
	--durations=25

test: $(VENV)/.installed-test slurm browser
	$(PYTEST) -m "(not slow or in_ci) and not tpu"

test-all: $(VENV)/.installed-test slurm browser
	$(PYTEST) -m "not tpu"

# `make test-tpu`: the TPU tier (tests/test_tpu_*.py, marked `tpu`) on a TPU machine whose Python already has JAX
# and libtpu: no venv (that JAX stays the one imported), the packages it lacks installed by pip into TPU_SITE
# (tests/tpu_setup.py; TPU_PIP_ARGS gives pip its index where the machine has no network, docs/tpu.md), src/ on
# the path, and one pytest process, since one program at a time can hold a chip. docs/tpu.md keeps the last run.
# TPU_TESTS and TPU_PYTEST_ARGS choose a part of the tier (e.g. TPU_PYTEST_ARGS="-k grpo") where a machine's command
# limit cuts the whole run in two.
TPU_SITE ?= .tpu-site
TPU_PIP_ARGS ?=
TPU_TESTS ?= tests/test_tpu_*.py
TPU_PYTEST_ARGS ?=
test-tpu:
	$(PYTHON) tests/tpu_setup.py $(TPU_SITE) $(TPU_PIP_ARGS)
	PYTHONPATH="$(CURDIR)/src:$${PYTHONPATH:+$$PYTHONPATH:}$(abspath $(TPU_SITE))" JAXLM_TEST_TPU=1 PYTHONUNBUFFERED=1 \
	$(PYTHON) -m pytest -p no:cacheprovider -p no:xdist -m tpu --durations=0 -rfE $(TPU_PYTEST_ARGS) $(TPU_TESTS)

bench: $(VENV)/.installed
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf outputs .pytest_cache
