# The two Quickstart commands: `make report` and `make test` (and `make lint`, which CI runs first, and
# `make test-slow`, the multi-process cases, which CI runs after `make test`). Each creates or updates .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: report test test-slow smoke-stable lint clean
STABLE := .venv-stable

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

# The smoke subset against the second combination (constraints-stable.txt): an environment that has its torch and
# Thunder first, then the package installed into it as a user would (pip install .), which must keep them.
smoke-stable:
	test -x $(STABLE)/bin/python || $(PYTHON) -m venv $(STABLE)
	$(STABLE)/bin/python -m pip install -q --upgrade pip
	$(STABLE)/bin/python -m pip install -q -r constraints-stable.txt
	$(STABLE)/bin/python -m pip install -q '.[test]'
	$(STABLE)/bin/python -m pip check
	PINS=constraints-stable.txt $(STABLE)/bin/python -m pytest -q -n 2 --dist loadfile -m smoke -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(STABLE) build *.egg-info
