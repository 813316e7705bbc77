# Each target does its own set-up: a virtual environment in .venv with pled installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/pled: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/pled
	$(BIN)/pled demo

test: $(BIN)/pled
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
