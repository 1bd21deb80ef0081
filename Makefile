# `make test` is the one test command (README, .ci/run): it makes .venv, installs, runs pytest.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test test-all shakespeare clean

$(BIN)/activate: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	touch $(BIN)/activate

venv: $(BIN)/activate

test: venv
	$(BIN)/python -m pytest -q

# the slow tests too (golden runs, benchmarks-as-tests)
test-all: venv
	$(BIN)/python -m pytest -q -m ""

clean:
	rm -rf $(VENV) .pytest_cache
