# Each target creates (or reuses) its own virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast docs bench

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.docs-installed: $(VENV)/.installed requirements-docs.txt
	$(PY) -m pip install -q -r requirements-docs.txt
	touch $@

demo: $(VENV)/.installed
	$(PY) experiments/seed_example.py

# Two pytest workers, a test module each at a time (module-scoped compiled steps stay shared): on 2 cores the
# suite's compiles and its launched processes overlap. More workers than cores only slows it down.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The smoke run: the tests marked fast (pytest -m fast): the README's and the docs' blocks, the seed example, and
# one equivalence test each for flax nnx, flax linen and ZeRO against one device.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m fast

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Writes under out/ only; add PUBLISH=--publish to refresh the committed files in docs/.
bench: $(VENV)/.installed
	$(PY) experiments/benchmark.py $(PUBLISH)
	$(PY) experiments/zero_memory.py $(PUBLISH)
