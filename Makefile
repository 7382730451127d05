# Two commands for a newcomer: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Airflow 2.10, the second Airflow line (the `airflow2` extra), in a virtualenv of its own.
VENV_AIRFLOW2 ?= .venv-airflow2
BIN_AIRFLOW2 := $(VENV_AIRFLOW2)/bin
PKG_DIRS := engine schemas topics runners replay client
# What make installs is pinned: one lock per environment and Python version (locks/), refreshed
# only by `make lock`, so an upstream release cannot change a test run between two commits.
PY_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
LOCK_MAIN := locks/python$(PY_VERSION)/main.txt
LOCK_AIRFLOW2 := locks/python$(PY_VERSION)/airflow2.txt
# Every runtime dependency at the lowest version pyproject.toml allows: the other end of its ranges.
LOCK_FLOORS := locks/python$(PY_VERSION)/floors.txt
VENV_FLOORS ?= .venv-floors
BIN_FLOORS := $(VENV_FLOORS)/bin
COMMA := ,
# The suite in parallel: a test spends much of its time waiting on brokers and processes.
# Tests sharing a module's Airflow deployment or a broker they change run on one worker.
PYTEST_WORKERS ?= 3
XDIST := -n $(PYTEST_WORKERS)
# pytest keeps its rewritten test modules as bytecode; without it every worker rewrites them all.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install check test lint typecheck unit integration airflow2 bench schemas clean kafka-jars demo lock floors

$(LOCK_MAIN) $(LOCK_AIRFLOW2) $(LOCK_FLOORS):
	@echo "no lock for Python $(PY_VERSION) ($@): 'make lock' resolves one from pyproject.toml" >&2
	@exit 1

# A virtualenv is made anew when pyproject.toml or its lock changes: pip cannot move an installed
# Airflow from one major line to another in place (Airflow 3 split into packages 2.10 did not
# have). Built with the lock's setuptools (no build isolation); the stamp names the lock, which
# tests/test_environment.py holds the virtualenv to. $(call make_venv,DIR,LOCK,EXTRAS,MODE)
# MODE: .venv's editable install is strict (a link tree under build/, which mypy follows, made
# anew by `make install`); the other two link the sources in place (no build/): they are built
# while the main suite runs, and a strict install empties and refills that one shared tree.
define make_venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q -c $(2) pip setuptools wheel
	$(1)/bin/pip install -q -c $(2) --no-build-isolation -e '.[$(3)]' $(4)
	echo $(2) > $(1)/bin/.deps
endef
STRICT := --config-settings editable_mode=strict

$(BIN)/.deps: pyproject.toml $(LOCK_MAIN)
	$(call make_venv,$(VENV),$(LOCK_MAIN),dev$(COMMA)airflow,$(STRICT))

$(BIN_AIRFLOW2)/.deps: pyproject.toml $(LOCK_AIRFLOW2)
	$(call make_venv,$(VENV_AIRFLOW2),$(LOCK_AIRFLOW2),dev$(COMMA)airflow2)

$(BIN_FLOORS)/.deps: pyproject.toml $(LOCK_FLOORS)
	$(call make_venv,$(VENV_FLOORS),$(LOCK_FLOORS),dev)

# Resolve the locks anew from pyproject.toml's ranges; commit them once `make test` passes.
lock:
	PYTHON=$(PYTHON) bash locks/refresh

# Re-link the editable install so new modules are importable and visible to mypy.
install: $(BIN)/.deps
	$(BIN)/pip install -q --no-deps --no-build-isolation -e . $(STRICT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy $(PKG_DIRS) tests bench

# The quick tier (a few minutes): lint, types, every test that needs no broker, and the
# integration tests that run on Tansu (those joining no consumer group, and those whose
# behaviour differs by broker), on Tansu alone.
check: lint typecheck
	DEFERLINE_TEST_BACKENDS=tansu $(BIN)/pytest $(XDIST) \
		-m "not integration or tansu_first or brokers_differ"

# Everything: every test on its brokers, then the Airflow 2.10 line and the floors. Their two
# virtualenvs are built meanwhile (mostly downloads: waiting the main suite hides); a failed
# build prints its log and fails the run.
OTHER_VENVS_LOG := $(VENV)/other-venvs.log
test: install
	@{ $(MAKE) --no-print-directory $(BIN_AIRFLOW2)/.deps $(BIN_FLOORS)/.deps \
		>$(OTHER_VENVS_LOG) 2>&1; echo $$? >$(OTHER_VENVS_LOG).rc; } & \
	$(MAKE) --no-print-directory lint typecheck && $(BIN)/pytest $(XDIST) --durations=30; \
	main=$$?; wait; \
	if [ "$$(cat $(OTHER_VENVS_LOG).rc)" != 0 ]; then \
		cat $(OTHER_VENVS_LOG); echo "building .venv-airflow2 or .venv-floors failed" >&2; exit 1; \
	fi; \
	exit $$main
	$(MAKE) --no-print-directory airflow2
	$(MAKE) --no-print-directory floors

# The tests of Airflow's trigger classes again on the Airflow 2.10 line, and its environment's.
airflow2: install $(BIN_AIRFLOW2)/.deps
	$(BIN_AIRFLOW2)/pytest $(XDIST) --durations=10 -m "airflow or environment"

# The tests that need no broker, with every runtime dependency at its floor.
floors: $(BIN_FLOORS)/.deps
	$(BIN_FLOORS)/pytest $(XDIST) -m "not integration and not airflow"

unit: install
	$(BIN)/pytest $(XDIST) -m "not integration"

integration: install
	$(BIN)/pytest $(XDIST) -m integration

# The whole loop on the embedded broker: ~2,000 tasks, a triggerer killed halfway (< 2 min).
# BROKER=kafka runs it on Apache Kafka (KRaft) from its jars instead (needs Java 17+).
BROKER ?= tansu
demo: install
	$(BIN)/deferline demo --broker $(BROKER)

# Apache Kafka's jars for the real-Kafka test broker (cached in ~/.cache/deferline; needs Maven once).
kafka-jars: install
	$(BIN)/python -m deferline.topics fetch-kafka-jars

schemas: install
	$(BIN)/python -m deferline.schemas.export docs/schemas

clean:
	rm -rf $(VENV) $(VENV_AIRFLOW2) $(VENV_FLOORS) build .mypy_cache .pytest_cache .ruff_cache
