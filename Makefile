# Two-command quick start: `make demo` and `make test`. Every target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verst-installed
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-slow test-gpu bench clean

install: $(STAMP)

# torch==2.13.0 first (the local CPU build), then verst with a constraint that keeps that torch.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m verst.recipes.demo

test: $(STAMP)
	$(VENV)/bin/ruff check verst tests bench
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

bench: $(STAMP)
	@for b in bench/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs build *.egg-info
