# The two Quickstart commands: `make report` and `make test` (and `make lint`, which CI runs first, and
# `make test-slow`, the multi-process cases, which CI runs after `make test`). Each creates or updates .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: report test test-slow lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' -c constraints.txt  # the ranges, at the exact versions CI proves
	touch $(STAMP)

report: $(STAMP)
	$(BIN)/thunder-fsdp-mem report

test: $(STAMP)  # two workers, each test file on one (its fixtures shared); the multi-process cases apart
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

test-slow: $(STAMP)  # the cases that run 2-rank torchrun processes (FSDP, the benchmark); CI runs them too
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m slow

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
