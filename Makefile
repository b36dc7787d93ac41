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

# every process of a test's job imports xmig's modules: compiled once here, since where
# PYTHONDONTWRITEBYTECODE is set each process would compile them again (0.25-0.5 s of CPU)
test: lint
	$(PY) -m compileall -q src tests examples > /dev/null
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .demo
