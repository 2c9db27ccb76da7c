# make demo: set up (first run) and run `megamoe bench` on the embedded default
#            (CPU: 2 gloo ranks on the tiny preset; a machine with CUDA GPUs: one rank per GPU)
# make test: set up (first run) and run the test suite (GPU tests skip without CUDA)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
# A machine whose python3 already has a CUDA torch (the GPU machine) runs from the source tree;
# anywhere else a virtual environment gets the CPU pins torch 2.13.0 and triton 3.6.0.
HAVE_CUDA := $(shell $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 && echo 1)
ifeq ($(HAVE_CUDA),1)
  PY := PYTHONPATH=$(CURDIR) $(PYTHON)
  SETUP :=
else
  PY := $(VENV)/bin/python
  SETUP := $(VENV)/.installed
endif

.PHONY: demo test test-gpu lint clean

demo: $(SETUP)
	$(PY) -m megamoe bench

test: $(SETUP)
	$(PY) -m pytest -q

test-gpu: $(SETUP)
	$(PY) -m pytest -q -m gpu

lint: $(SETUP)
	$(PY) -m ruff check megamoe tests benchmarks examples

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0 triton==3.6.0
	$(VENV)/bin/python -m pip install -q -e '.[dev,plot]'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
