#!/usr/bin/env bash
# The GPU side of the benchmarks, for an offline GPU machine (Python 3.12, torch 2.11, transformers 5.17, Triton).
#   bash bench/gpu.sh wheels             here: download what the GPU machine lacks (below)
#   bash bench/gpu.sh run PART [OUT]     there: one part of the measurements the docs quote, each inside one
#                                        10-minute call: quick | qlora | ckpt-1b | ckpt-8b | serve | serve-fused | step | fit
# `run` writes results (JSON Lines / JSON) to OUT (default: $OUT, else /tmp/gpu-runs).
#
# wheels: the peers bench/train_throughput.py runs and what `tunesmith serve` needs, as wheels into .whl/<set>/
# (keep .whl/ out of git: `echo /.whl/ >> .git/info/exclude`). Each set stays under one 64 MiB transfer; on the GPU
# machine install a set with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/<set>/*.whl && export PYTHONPATH=/tmp/site
# Or one transfer for all: every set is also unpacked into .whl/slim/site.tar.xz (about 25 MiB), without
# bitsandbytes' libraries for CUDA 11/12 (torch 2.11 there is built for CUDA 13) and Unsloth's web UI (studio/,
# which training never imports); `run` unpacks it into /tmp/site (a warm machine keeps it).
# Versions: unsloth 2026.10.9 allows transformers <= 5.17.0, trl <= 1.15.0, datasets < 5.
set -uo pipefail

wheels() {
  set -e
  get() {  # set, then name==version...
    local set=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      -d ".whl/$set" "$@"
  }
  get liger liger-kernel==0.8.5
  get common datasets==4.8.5 dill==0.4.1 docstring-parser==0.18.0 multiprocess==0.70.19 shtab==1.13.0 trl==1.15.0 \
    typeguard==4.6.1 tyro==1.0.17
  get bnb bitsandbytes==0.50.2
  get unsloth unsloth==2026.10.9 unsloth-zoo==2026.10.9 annotated-types==0.8.0 cut-cross-entropy==25.1.1 \
    hf-transfer==0.1.9 json5==0.17.3 msgspec==0.23.0 nest-asyncio==1.6.0 pydantic==2.13.5 pydantic-core==2.46.5 \
    structlog==26.1.0 torchao==0.18.0 typing-inspection==0.4.2
  # `tunesmith serve` and bench/bench_serve.py's clients (fastapi's and openai's own needs; pydantic comes with unsloth's)
  get serve fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3 \
    openai==3.63.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 idna==3.21 \
    anyio==4.16.0 typing_extensions==4.16.0 gguf==0.19.0
  site=$(mktemp -d)
  for w in .whl/liger/*.whl .whl/common/*.whl .whl/bnb/*.whl .whl/unsloth/*.whl .whl/serve/*.whl; do
    unzip -q -o "$w" -d "$site"
  done
  rm -rf "$site"/bitsandbytes/libbitsandbytes_cuda1[12]*.so "$site/studio"
  mkdir -p .whl/slim && tar -C "$site" -cJf .whl/slim/site.tar.xz . && rm -rf "$site"
  du -sh .whl/*
}

run() {
  local part=${1:?"PART: quick | qlora | ckpt-1b | ckpt-8b | serve | serve-fused | step | fit"}
  local out=${2:-${OUT:-/tmp/gpu-runs}}
  mkdir -p "$out"
  if [ ! -f /tmp/site/.unpacked ] && [ -f .whl/slim/site.tar.xz ]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/slim/site.tar.xz && touch /tmp/site/.unpacked
  fi
  export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  tt() { python3 bench/train_throughput.py --device cuda --tools tunesmith,unsloth --dropout 0 --out "$out/$part.jsonl" "$@"; }
  case $part in
    quick) tt --rows smoke-qlora --tools tunesmith --steps 4 --warmup 1  # the nf4 paths build and train
           tt --rows llama-1b-qlora --steps 8 --warmup 3 ;;  # a ratio in a minute
    qlora) tt --rows llama-8b-qlora --steps 12 --warmup 4 --repeat 2 ;;
    ckpt-1b) tt --rows llama-1b-ckpt --steps 15 --warmup 4 --repeat 2 ;;
    ckpt-8b) tt --rows llama-8b-ckpt --steps 12 --warmup 4 --repeat 2 ;;
    serve)
      for shape in meta-llama/Llama-3.2-1B HuggingFaceTB/SmolLM2-135M-Instruct; do
        timeout 280 python3 bench/bench_serve.py --shape "$shape" --device cuda --clients 8 --max-tokens 128 --trace \
          --json "$out/serve-${shape##*/}.json" 2>&1 | grep -v " INFO" | tail -40
      done ;;
    serve-fused)  # both shapes' servers with the fused LoRA addition (the default) and with PyTorch's two ops, in turn
      for shape in meta-llama/Llama-3.2-1B HuggingFaceTB/SmolLM2-135M-Instruct; do
        for unfused in "" --unfused; do
          timeout 140 python3 bench/bench_serve.py --shape "$shape" --device cuda --clients 8 --max-tokens 128 \
            --no-hf-reference --trace $unfused --json "$out/serve-${shape##*/}${unfused:+-unfused}.json" 2>&1 \
            | grep -v " INFO" | tail -14
        done
      done ;;
    step)  # the decode step alone, the fused LoRA addition against PyTorch's two ops (the 1B shape)
      timeout 200 python3 bench/bench_serve.py --step --device cuda --runs 5 --json "$out/step-Llama-3.2-1B.json" 2>&1 \
        | grep -v " INFO" | tail -40 ;;
    fit) python3 bench/qlora_acceptance.py --device cuda --parallel --out "$out/qlora-cuda.json" ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
}

case ${1:-} in
  wheels) wheels ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash bench/gpu.sh wheels | run PART [OUT]"; exit 2 ;;
esac
