# Two commands from a fresh clone:
#   make demo    set up .venv (CPU torch, then Flotilla) and train the demo
#   make test    set up .venv with the dev extra and run the test suite (without the long
#                end-to-end runs marked slow: `make test-slow` runs those; CI runs both)
# And the docs: `make docs` serves the site at http://127.0.0.1:8000 (mkdocs serve),
# `make docs-build` builds it strictly into site/ (broken links fail).
# Variables: PYTHON=python3.11 picks the interpreter; TORCH=cpu|cuda picks the torch
# build (cpu pins the CPU wheel, cuda lets pip choose); ARGS="--set seed=1" is passed
# to `flotilla run`. The install is redone only when pyproject.toml changes.

PYTHON ?= python3
TORCH ?= cpu
ARGS ?=
CONFIG ?= examples/guess_number.toml
VENV := .venv
TORCH_PIN_cpu := torch==2.13.0
TORCH_PIN_cuda :=

ifeq ($(filter $(TORCH),cpu cuda),)
$(error TORCH must be cpu or cuda, not '$(TORCH)')
endif

.PHONY: demo test test-slow test-verifiers lint docs docs-build clean

demo: $(VENV)/.installed-$(TORCH)
	$(VENV)/bin/flotilla run $(CONFIG) $(ARGS)

test: $(VENV)/.installed-$(TORCH)-dev
	$(VENV)/bin/python -m pytest -q -m "not slow" --durations=20

# The long end-to-end runs (marked slow): whole training runs, faults, networks, Slurm.
test-slow: $(VENV)/.installed-$(TORCH)-dev
	$(VENV)/bin/python -m pytest -q -m slow --durations=20

# ruff (lint and format) and the import-linter layer contracts of pyproject.toml.
lint: $(VENV)/.installed-$(TORCH)-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

docs: $(VENV)/.installed-$(TORCH)-dev
	$(VENV)/bin/mkdocs serve

docs-build: $(VENV)/.installed-$(TORCH)-dev
	$(VENV)/bin/mkdocs build --strict


# verifiers cannot share the dev extra's environment (pyproject.toml says why): its tests
# (skipped by `make test`) run here, in a venv of their own.
VENV_VF := .venv-verifiers
test-verifiers: $(VENV_VF)/.installed-$(TORCH)
	$(VENV_VF)/bin/python -m pytest -q tests/unit/actors/test_env_libraries.py \
		tests/integration/test_env_libraries_run.py -k verifiers

$(VENV_VF)/.installed-$(TORCH): pyproject.toml
	$(PYTHON) -m venv $(VENV_VF)
	$(VENV_VF)/bin/pip install --quiet --upgrade pip
	$(if $(TORCH_PIN_$(TORCH)),$(VENV_VF)/bin/pip install --quiet $(TORCH_PIN_$(TORCH)))
	$(VENV_VF)/bin/pip install --quiet -e '.[verifiers]' "pytest>=8" "pytest-trio>=0.8" "pytest-timeout>=2.3"
	touch $@

clean:
	rm -rf $(VENV) $(VENV_VF) runs site

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip

# The pinned CPU torch goes in first: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed-$(TORCH): pyproject.toml | $(VENV)/bin/python
	$(if $(TORCH_PIN_$(TORCH)),$(VENV)/bin/pip install --quiet $(TORCH_PIN_$(TORCH)))
	$(VENV)/bin/pip install --quiet -e .
	touch $@

$(VENV)/.installed-$(TORCH)-dev: pyproject.toml | $(VENV)/bin/python
	$(if $(TORCH_PIN_$(TORCH)),$(VENV)/bin/pip install --quiet $(TORCH_PIN_$(TORCH)))
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed-$(TORCH)
