# Two entry points: `make demo` and `make test`. Both set up .venv on first use, from the lock.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The development and CI machines serve torch 2.13.0 as a local CPU wheel; an unpinned torch would pull
# a multi-GB CUDA build. The package itself accepts the torch range in pyproject.toml; on a GPU machine
# with torch already installed use e.g. `make test TORCH_SPEC= VENV_FLAGS=--system-site-packages`.
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
# Every other package of the test environment, pinned (regenerate with `make lock`).
LOCK ?= requirements/test.lock
# The oldest versions seqmesh declares (pyproject.toml's floors), pinned the same way: `make test-floor`.
FLOOR_VENV ?= .venv-floor
FLOOR_LOCK ?= requirements/floor.lock

.PHONY: install test test-floor demo gpu-check bench lock clean

$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_SPEC),"$(TORCH_SPEC)") -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pip check
	touch $@

install: $(VENV)/.installed

# Two pytest workers (pytest-xdist), one per core of the machines this project runs on: a multi-rank test leaves a
# core idle a third of its time (its ranks wait on each other's messages), and the other worker fills it. Each test
# file runs whole on one worker (--dist loadfile), so its cases share that worker's rank pools and references.
# --durations=15: the 15 slowest tests, for the time ledger in docs/testing.md (no test asserts a duration)
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The focused subset (tests/floor_subset.txt) in a second environment at the declared floors.
# torch 2.9.1 from PyPI is a CUDA build: 7 GB installed. Without pip's cache (which would keep the 4 GB of
# wheels too) and with the nvidia wheels installed one at a time, the peak stays near the final size; the
# free-space check fails in seconds, with the reason, instead of minutes into the install.
FLOOR_DISK_GB ?= 9
$(FLOOR_VENV)/.installed: pyproject.toml Makefile $(FLOOR_LOCK)
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt "$(FLOOR_DISK_GB)" ]; then \
	  echo "make test-floor: $(FLOOR_VENV) needs about $(FLOOR_DISK_GB) GB free here (torch 2.9.1 from PyPI is a CUDA build); $$free GB is free. Free some space, or set FLOOR_DISK_GB to try anyway." >&2; \
	  exit 1; \
	fi
	$(PYTHON) -m venv $(FLOOR_VENV)
	grep -i '^nvidia-' $(FLOOR_LOCK) | xargs -n 1 $(FLOOR_VENV)/bin/python -m pip install -q --no-cache-dir --no-deps
	$(FLOOR_VENV)/bin/python -m pip install -q --no-cache-dir -r $(FLOOR_LOCK)
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps -e .
	$(FLOOR_VENV)/bin/python -m pip check
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m seqmesh versions
	$(FLOOR_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $$(grep -v '^#' tests/floor_subset.txt)

demo: install
	$(PY) -m seqmesh demo

# The first GPU run (docs/gpu.md): in the environment seqmesh is installed in, with its CUDA torch; installs nothing.
gpu-check:
	$(PYTHON) -m seqmesh selftest

bench: install
	$(PY) -m seqmesh bench attention
	$(PY) -m seqmesh bench merge

# A fresh resolution of pyproject.toml's [test] extra beside TORCH_SPEC, written to the lock.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q $(if $(TORCH_SPEC),"$(TORCH_SPEC)") -e ".[test]"
	head -3 $(LOCK) > $(LOCK).new
	.venv-lock/bin/python -m pip freeze --exclude-editable | grep -iv '^torch==' >> $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .venv-lock *.egg-info .pytest_cache
