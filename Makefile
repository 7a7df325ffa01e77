# Each target creates (or reuses) its own virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# The smoke run: the README's and the docs' blocks, the seed example, and one equivalence test each for flax nnx,
# flax linen and ZeRO against one device.
FAST_TESTS := README.md docs tests/test_docs.py tests/test_seed_example.py \
  tests/test_nnx.py::test_training_an_nnx_module_matches_the_ordinary_single_device_program \
  tests/test_linen.py::test_trained_on_four_devices_equals_flax_on_one_device \
  "tests/test_zero.py::test_per_token_weights_with_accumulation[3]"

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

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q $(FAST_TESTS)

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Writes under out/ only; add PUBLISH=--publish to refresh the committed files in docs/.
bench: $(VENV)/.installed
	$(PY) experiments/benchmark.py $(PUBLISH)
	$(PY) experiments/zero_memory.py $(PUBLISH)
