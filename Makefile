# Two entry points: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The development and CI machines serve torch 2.13.0 as a local CPU wheel; an unpinned torch would pull
# a multi-GB CUDA build. The package itself accepts any torch >= 2.6 (see pyproject.toml); on a GPU
# machine with torch already installed use e.g. `make test TORCH_SPEC= VENV_FLAGS=--system-site-packages`.
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=

.PHONY: install test demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m seqmesh demo

bench: install
	$(PY) -m seqmesh bench attention
	$(PY) -m seqmesh bench merge

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
