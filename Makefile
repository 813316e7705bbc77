# Each target does its own set-up: a virtual environment in .venv with pled installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-systemd bench clean

$(BIN)/pled: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/pled
	$(BIN)/pled demo

test: $(BIN)/pled
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Opt-in: pled.service under real systemd as PID 1, fenced in namespaces (see tests/test_systemd_pid1.py).
test-systemd: $(BIN)/pled
	PLED_TEST_SYSTEMD=1 $(BIN)/python -m pytest tests/test_systemd_pid1.py -v

# Measurements, not tests: writes docs/BENCHMARKS.md and docs/benchmarks.json (a few minutes, about 4 GiB).
bench: $(BIN)/pled
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
