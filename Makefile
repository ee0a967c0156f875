# The three commands of README.md. Each later one sets up first if needed.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup optimize test
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml infra/setup.sh
	bash infra/setup.sh $(VENV)
	touch $@

optimize: setup
	$(BIN)/infersmith optimize --op rmsnorm --model tiny --budget 8

# Two workers: CI has two cores, and most tests wait on harness subprocesses.
test: setup
	$(BIN)/python -m pytest -q -ra -n 2 --durations=20
