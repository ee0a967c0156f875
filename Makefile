# The commands of README.md. Each later one sets up first if needed.
VENV ?= .venv
BIN := $(VENV)/bin
# The linters live in a venv of their own: aiperf pins rich~=14.1, and import-linter's current
# releases need rich>=14.2.
LINT_VENV ?= .venv-lint
LINTERS := ruff==0.17.6 import-linter==2.17

.PHONY: setup optimize test lint mutations gpu-check
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml infra/setup.sh
	bash infra/setup.sh $(VENV)
	touch $@

$(LINT_VENV)/.installed: Makefile
	[ -x $(LINT_VENV)/bin/python ] || python3 -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q $(LINTERS)
	touch $@

optimize: setup
	$(BIN)/infersmith optimize --op rmsnorm --model tiny --budget 8

# ruff, then the import contracts of pyproject.toml (the house as docs/ARCHITECTURE.md draws it).
lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check .
	PYTHONPATH=. $(LINT_VENV)/bin/lint-imports --no-cache

# Two workers: CI has two cores, and most tests wait on harness subprocesses.
test: setup lint
	$(BIN)/python -m pytest -q -ra -n 2 --durations=20

# Each harness defence listed in tests/mutations.toml removed in turn, in a copy of the repository:
# the tests it names must fail (docs/testing.md). Two at a time, as for the tests.
mutations: setup
	$(BIN)/python tests/mutations.py --jobs 2

# On a GPU host: every path only a GPU exercises, in one call of at most 9 minutes, with one report
# under $(OUT) (docs/testing.md#on-a-gpu-make-gpu-check). `python3 bench/gpu_check.py --plan` lists it.
gpu-check:
	bash bench/gpu_check.sh
