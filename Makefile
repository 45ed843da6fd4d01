# The two commands: `make demo` runs the main job, `make test` runs every test. Both set up .venv first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
STAMP   := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' $(foreach p,$(PLUGINS),-e ./$(p))
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/nexuskv demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/nexuskv --log-level warning schema export --check

test: lint
	$(PY) -m pytest

bench: setup
	$(PY) bench/identity.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
