# Each target creates (or reuses) its own virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: $(VENV)/.installed
	$(PY) experiments/seed_example.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

# Writes under out/ only; add PUBLISH=--publish to refresh the committed files in docs/.
bench: $(VENV)/.installed
	$(PY) experiments/benchmark.py $(PUBLISH)
	$(PY) experiments/zero_memory.py $(PUBLISH)
