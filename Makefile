# The README's two commands: `make demo` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint typecheck unit e2e install clean

install:
	@bash scripts/bootstrap.sh $(VENV)

demo: install
	$(VENV)/bin/kvturn demo

test: install lint typecheck
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest --ignore=tests/e2e

e2e: install
	$(PY) -m pytest tests/e2e

clean:
	rm -rf $(VENV) .kvturn .mypy_cache .ruff_cache .pytest_cache
