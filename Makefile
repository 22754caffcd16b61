# The two Quickstart commands: `make report` and `make test` (and `make lint`, which CI runs first). Each creates or
# updates .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: report test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

report: $(STAMP)
	$(BIN)/thunder-fsdp-mem report

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile  # two workers, each test file on one (its fixtures shared)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
