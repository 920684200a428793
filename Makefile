# Two commands on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# The main test run compiles XLA:CPU code at LLVM -O0 without its expensive passes. Most tests
# spend their time compiling a tiny model's shapes once, not running them: on 29 engine tests
# (speculative decoding, steady decode; -n 2) 348 -> 246 s, while a run-heavy set (the GGUF
# chat goldens, packed weights, preemption) went 387 -> 443 s. Results are the same (FP
# semantics do not depend on the LLVM level); the compile tier (tests/aot) keeps the
# defaults, since its register and shared-memory checks are about the optimised code.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
# The deviceless GPU compile tier (pagedjax.aot) lives in its own venv: jax's CUDA plugin and
# NVIDIA's compiler wheels next to a CPU jax, so the main venv never tries to load CUDA.
AOT_VENV := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed
AOT_ENV := JAX_PLATFORMS=cpu TF_CPP_VMODULE=nvjitlink=3 TF_CPP_MIN_LOG_LEVEL=0
TARGETS ?= h100,a100,b200
# make gpu-suite STAGE=kernels|bench|e2e|paper|all [DRY_RUN=1] (docs/gpu.md)
STAGE ?= all

.PHONY: venv aot-venv aiperf-venv demo test lint bench clean aot-report aot-full gpu-suite serve-aiperf

$(PYTHON):
	"$$(tools/find_python.sh)" -m venv $(VENV)

# Re-install when the project's dependencies change.
$(STAMP): pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

$(AOT_VENV)/bin/python:
	"$$(tools/find_python.sh)" -m venv $(AOT_VENV)

$(AOT_STAMP): pyproject.toml | $(AOT_VENV)/bin/python
	$(AOT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AOT_VENV)/bin/python -m pip install --quiet -e '.[aot]'
	touch $(AOT_STAMP)

aot-venv: $(AOT_STAMP)

demo: venv
	$(VENV)/bin/pagedjax fetch-demo
	$(VENV)/bin/pagedjax generate "$(PROMPT)"

test: venv aot-venv
	$(VENV)/bin/pagedjax fetch-demo
	$(VENV)/bin/pagedjax fetch-model gemma3-270m
	$(VENV)/bin/ruff check pagedjax pallas_kernels models tests bench tools
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(VENV)/bin/python -m pytest -n 2 --timeout 1200 \
		--ignore=tests/aot $(PYTEST_ARGS)
	$(AOT_ENV) $(AOT_VENV)/bin/python -m pytest -n 2 --dist loadgroup --timeout 1800 tests/aot

# Rebuild the committed compile reports (bench/results/aot-<target>/report.json). Kernels
# whose lowered IR is unchanged keep their entries; AOT_ARGS=--fresh compiles all again.
aot-report: aot-venv
	$(AOT_ENV) $(AOT_VENV)/bin/python -m pagedjax.aot --targets $(TARGETS) $(AOT_ARGS)

# The compile tier compiling every kernel and step instead of a sample (`make test` compiles
# a sample and checks the rest by IR digest: tests/aot/test_compile_tier.py).
aot-full: aot-venv
	PAGEDJAX_AOT_FULL=1 $(AOT_ENV) $(AOT_VENV)/bin/python -m pytest -n 2 --dist loadgroup \
		--timeout 3600 tests/aot

# The one command for a lent GPU (docs/gpu.md); DRY_RUN=1 runs it at toy shapes on CPU.
gpu-suite: venv
	$(PYTHON) -m bench.gpu_suite --stage $(STAGE) $(if $(DRY_RUN),--dry-run)

lint: venv
	$(VENV)/bin/ruff check pagedjax pallas_kernels models tests bench tools

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .ruff_cache

# NVIDIA's aiperf (a third-party OpenAI-API benchmark client) in a venv of its own, for
# `bench/serve.py --protocols http,aiperf` (its dependencies stay out of the engine's venv).
AIPERF_VENV := .venv-aiperf
$(AIPERF_VENV)/bin/aiperf:
	"$$(tools/find_python.sh)" -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --quiet aiperf==0.13.0

aiperf-venv: $(AIPERF_VENV)/bin/aiperf

# Our load generator and aiperf against one `pagedjax serve`, same arrivals, interleaved.
serve-aiperf: venv aiperf-venv
	$(PYTHON) bench/serve.py --protocols http,aiperf --rates 0.5,1,2 --num-requests 24 \
		--reps 2 --scale 0.5 --tag aiperf
