# The two commands of the README: `make serve` and `make test`. Each sets up .venv first
# (idempotent: reinstalls only when pyproject.toml changed).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mixbit-installed
# MLX's Linux wheel bundles a reference BLAS; `mixbit` itself loads the cmeel-openblas wheel (or a
# system OpenBLAS) before MLX (models/blas.py). That wheel needs libgfortran.so.5: `setup` installs
# Debian's OpenBLAS as root, which brings it (and is the fallback BLAS).
OPENBLAS = $(firstword $(wildcard /usr/lib/*/openblas-pthread/libopenblas.so.0))

.PHONY: setup serve test test-tools bench clean llama-quality

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,train]"
	@if [ -z "$(OPENBLAS)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1)) \
		|| echo "note: OpenBLAS not installed; MLX uses its bundled BLAS (slower prefill)"; \
	fi
	@touch $@

serve: setup
	$(VENV)/bin/mixbit serve

# The metrics end-to-end test scrapes the server with a real Prometheus (Debian's package).
test-tools:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1)); } \
		|| echo "note: no prometheus binary; tests/test_metrics.py needs one (apt-get install prometheus)"

test: setup test-tools
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache

# docs/llama-quality.md: mixbit against llama.cpp's K-/i-quants on the same tokens (builds
# llama.cpp from PyPI's llama-cpp-python sdist into .cache/llama.cpp when missing: needs g++)
llama-quality: setup
	$(PY) tests/bench/llama_quality.py
