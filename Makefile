# Two commands do everything on a fresh machine:
#   make repro   — set up .venv, then run the whole DAG (stages in parallel, recorded by DVC) on the built-in data
#   make test    — set up .venv, then run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DO_NOT_TRACK := 1
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GX_ANALYTICS_ENABLED := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Stage commands in dvc.yaml call `python`: make it the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: repro test browser setup params check lint lock bench bench-flow clean-venv inspect serve stop

setup: $(STAMP) .dvc/config

# Reinstall whenever the lock changes. torch/torchvision are pinned to the builds on this machine's disk.
# The lock is the whole environment (setuptools too), so pip installs exactly it (--no-deps: nothing
# unpinned comes in, and pip skips re-resolving 250 pins) and `pip check` fails a lock that misses one.
$(STAMP): requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-warn-script-location --no-deps -r requirements.lock 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
	$(PY) -m pip check
	@touch $@

# DVC is initialised on first use (the repo ships .dvc/config; this covers a stripped checkout).
.dvc/config:
	$(VENV)/bin/dvc init --quiet
	$(VENV)/bin/dvc config core.analytics false
	$(VENV)/bin/dvc config core.check_update false
	$(VENV)/bin/dvc config hydra.enabled true

# The DAG through the Prefect flow (pipeline/flows.py): independent stages run at once, up to
# JOBS (default: the cores available), each recorded by DVC exactly as `dvc repro` records it
# (pipeline/parallel.py); `dvc repro` stays the plain serial path to the same outputs. No server
# needed (Prefect starts a temporary one). On failure the flow puts the last good outputs back
# from DVC's cache. One run per workspace (pipeline/lock.py): a second `make repro` fails fast
# naming the running one; `make repro WAIT=1` queues behind it instead.
repro: setup check
	$(PY) -m pipeline.flows $(if $(filter 1 yes true,$(WAIT)),--wait) $(if $(JOBS),--max-parallel $(JOBS))

test: setup browser
	$(PY) -m pytest -n 2 --dist loadgroup -q --durations=10

# tests/test_report_html.py opens the report in headless Chromium. Where it is missing and this is
# root with apt-get (a container, a CI box), install it as .ci/run does: quietly and bounded. If
# that cannot be done or fails, the test is SKIPPED naming the command that installs it (.ci/run
# sets SHIFTLAB_REQUIRE_BROWSER=1, which fails it instead).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null || exit 0; \
	  echo "make: installing chromium for tests/test_report_html.py (apt-get, at most 10 min)"; \
	  log=$$(mktemp); \
	  if timeout 120 apt-get update -qq >$$log 2>&1 && \
	     DEBIAN_FRONTEND=noninteractive timeout 480 apt-get install -y -qq chromium >>$$log 2>&1; then rm -f $$log; \
	  else echo "make: could not install chromium (apt-get's output: $$log); tests/test_report_html.py will be skipped"; fi; }

# Validate params.yaml against the schemas before any stage runs.
check: setup
	$(PY) -m stages.core.config check

# Explain an artifact: `make inspect PATH=data/predictions/...parquet` (ARTIFACT=... works too;
# without one: all of data/). PATH given on the command line names the artifact, so the
# shell's search path is rebuilt for the recipes.
ifeq ($(origin PATH),command line)
ARTIFACT := $(PATH)
override PATH := $(abspath $(VENV))/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
endif
inspect: setup
	@$(PY) -m pipeline.inspect $(or $(ARTIFACT),data)

# Recompose params.yaml from conf/ (what `dvc exp run` does automatically), and bring
# dvc.yaml's code dependencies in step with the stages' imports (stages/dag.py).
params: setup
	$(PY) -m stages.core.config compose
	$(PY) -m stages.dag

# Prefect UI on http://127.0.0.1:4200 (SQLite under .prefect/), the `shiftlab` work pool, the
# deployments of prefect.yaml and a worker; `make stop` stops what it started (pid files in .prefect/).
serve: setup
	bash pipeline/serve.sh

stop:
	bash pipeline/stop.sh

lint: setup
	$(VENV)/bin/ruff check stages pipeline tests benchmarks

bench: setup
	$(PY) -m benchmarks.bench_train
	$(PY) -m benchmarks.bench_repro

# The Prefect flows against plain DVC (README, "Orchestration overhead"): tiny DAG and sweep,
# ~15 min on an idle 2-core machine. BENCH_FLOW_ARGS="--runs 3 --override 'run.seeds=[0]' --skip-sweep"
# measures the default DAG (~25 min).
bench-flow: setup
	$(PY) -m benchmarks.bench_flow $(BENCH_FLOW_ARGS)

# Regenerate requirements.lock from requirements.in: resolve it in a throw-away venv and pin all of
# that (setuptools too; not pip itself). torch/torchvision lose their local build tag (+cpu/+cu13x).
lock:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp/venv" && \
	"$$tmp/venv/bin/pip" install --quiet --no-warn-script-location -r requirements.in 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) && \
	"$$tmp/venv/bin/pip" check && \
	{ echo '# Full pinned set (setuptools too): `pip freeze --all` of requirements.in resolved in a fresh venv. Regenerate with `make lock`.'; \
	  "$$tmp/venv/bin/pip" freeze --all --exclude pip | sed -E 's/^(torch|torchvision)==([0-9.]+)\+(cpu|cu[0-9]+)$$/\1==\2/'; } > requirements.lock.new && \
	mv requirements.lock.new requirements.lock

clean-venv:
	rm -rf $(VENV)
