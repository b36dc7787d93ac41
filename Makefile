# make demo: install into .venv, then run the 2-rank CPU demo with an injected fault
# make test: install into .venv, then lint and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the CPU build of PyTorch; override (e.g. TORCH_SPEC=torch==2.11.0) where another one fits
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $@

demo: install
	$(PY) examples/demo.py

lint: install
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .demo
