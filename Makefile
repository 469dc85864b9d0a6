# kvobs — the two commands: `make demo` and `make test`. Each sets up .venv by itself.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.kvobs-installed

.PHONY: venv prometheus tools test lint typecheck demo bench clean

venv: $(STAMP)

# torch 2.13.0 CPU build first, then vLLM 0.33.0 without its GPU dependencies,
# then the deps its scheduler-side code needs (notes §6), then kvobs itself.
$(STAMP): pyproject.toml setup.py kvobs/_recording.py requirements/vllm-cpu.txt
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "kvobs needs Python >= 3.11"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q --no-deps "vllm==0.33.0"
	$(PIP) install -q -r requirements/vllm-cpu.txt
	$(PIP) install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"
	$(PIP) install -q -e '.[otlp,dev]'
	touch $(STAMP)

# The export tests scrape the sidecar with Debian's real Prometheus server.
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@prometheus --version 2>&1 | head -1

# The docker/ tests validate docker/compose.yaml with Debian's docker-compose (1.29, no engine needed).
tools: prometheus
	@command -v docker-compose >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; }
	@docker-compose version 2>&1 | head -1

lint: $(STAMP)
	$(VENV)/bin/ruff check kvobs tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The whole suite on kvobs's compiled hot path, then the tests that matter for it again on its
# pure-Python form (what kvobs runs where no C compiler compiled kvobs/_recording.py).
test: $(STAMP) tools lint typecheck
	$(PY) -m pytest -q tests
	KVOBS_PURE_PYTHON=1 $(PY) -m pytest -q -p no:cacheprovider tests/unit \
	  tests/integration/test_transparency.py tests/integration/test_causes.py \
	  tests/reliability/test_reliability_transparency.py tests/reliability/test_reliability_concurrency.py

demo: $(STAMP)
	$(VENV)/bin/kvobs demo

# kvobs against its baselines (overhead, history, sidecar); a few minutes; results also in bench-results/.
bench: $(STAMP)
	$(PY) -m benchmarks.overhead --json bench-results/overhead.json
	$(PY) -m benchmarks.overhead_connector --json bench-results/overhead_connector.json
	$(PY) -m benchmarks.history --json bench-results/history.json
	$(PY) -m benchmarks.sidecar --json bench-results/sidecar.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
