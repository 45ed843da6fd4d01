# The two commands: `make demo` runs the main job, `make test` runs every test. Both set up .venv first
# (and `make test` installs Debian's redis-server when it is missing: the Redis tier's tests need the binary).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
STAMP   := $(VENV)/.installed

.PHONY: setup demo test lint bench clean redis-server

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' $(foreach p,$(PLUGINS),-e ./$(p))
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/nexuskv demo
	$(VENV)/bin/nexuskv engine-demo

# The Redis tier's tests start their own redis-server on 127.0.0.1; install Debian's when it is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/nexuskv --log-level warning schema export --check

test: lint redis-server
	$(PY) -m pytest

bench: setup
	$(PY) bench/identity.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
