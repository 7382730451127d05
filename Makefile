# Two commands for a newcomer: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Airflow 2.10, the second Airflow line (the `airflow2` extra), in a virtualenv of its own.
VENV_AIRFLOW2 ?= .venv-airflow2
BIN_AIRFLOW2 := $(VENV_AIRFLOW2)/bin
PKG_DIRS := engine schemas topics runners replay client

.PHONY: install test lint typecheck unit integration airflow2 bench schemas clean kafka-jars demo

# A virtualenv is made anew when pyproject.toml changes: pip cannot move an installed Airflow
# from one major line to another in place (Airflow 3 split into packages 2.10 did not have).
$(BIN)/.deps: pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -e '.[dev,airflow]' --config-settings editable_mode=strict
	touch $@

$(BIN_AIRFLOW2)/.deps: pyproject.toml
	rm -rf $(VENV_AIRFLOW2)
	$(PYTHON) -m venv $(VENV_AIRFLOW2)
	$(BIN_AIRFLOW2)/pip install -q --upgrade pip setuptools wheel
	$(BIN_AIRFLOW2)/pip install -q -e '.[dev,airflow2]' --config-settings editable_mode=strict
	touch $@

# Re-link the editable install so new modules are importable and visible to mypy.
install: $(BIN)/.deps
	$(BIN)/pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy $(PKG_DIRS) tests bench

test: lint typecheck
	$(BIN)/pytest
	$(MAKE) airflow2

# The tests of Airflow's trigger classes again on the Airflow 2.10 line.
airflow2: install $(BIN_AIRFLOW2)/.deps
	$(BIN_AIRFLOW2)/pytest -m airflow

unit: install
	$(BIN)/pytest -m "not integration"

integration: install
	$(BIN)/pytest -m integration

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
	rm -rf $(VENV) $(VENV_AIRFLOW2) build .mypy_cache .pytest_cache .ruff_cache
