#!/usr/bin/env bash
# The GPU measurements the docs quote, in parts that each end inside one 10-minute call on an offline GPU machine
# (torch, transformers, peft and Triton there; the rest carried as bench/gpu_wheels.sh's .whl/slim/site.tar.xz).
#   bash bench/gpu_runs.sh PART [OUT]      PART: qlora | ckpt-1b | ckpt-8b | serve | fit | quick
# Results (JSON Lines / JSON) and logs go to OUT (default: $OUT, else /tmp/gpu-runs).
set -uo pipefail
part=${1:?"PART: qlora | ckpt-1b | ckpt-8b | serve | fit | quick"}
out=${2:-${OUT:-/tmp/gpu-runs}}
mkdir -p "$out"
if [ ! -f /tmp/site/.unpacked ] && [ -f .whl/slim/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/slim/site.tar.xz && touch /tmp/site/.unpacked
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
tt() { python3 bench/train_throughput.py --device cuda --tools tunesmith,unsloth --dropout 0 --out "$out/$part.jsonl" "$@"; }
case $part in
  quick) tt --rows smoke-qlora,llama-1b-qlora --steps 8 --warmup 3 ;;  # the nf4 paths build and train; a 1B ratio
  qlora) tt --rows llama-8b-qlora --steps 12 --warmup 4 --repeat 2 ;;
  ckpt-1b) tt --rows llama-1b-ckpt --steps 15 --warmup 4 --repeat 2 ;;
  ckpt-8b) tt --rows llama-8b-ckpt --steps 12 --warmup 4 --repeat 2 ;;
  serve)
    for shape in meta-llama/Llama-3.2-1B HuggingFaceTB/SmolLM2-135M-Instruct; do
      timeout 280 python3 bench/bench_serve.py --shape "$shape" --device cuda --clients 8 --max-tokens 128 \
        --json "$out/serve-${shape##*/}.json" 2>&1 | grep -v " INFO" | tail -40
    done ;;
  fit) python3 bench/qlora_acceptance.py --device cuda --parallel --out "$out/qlora-cuda.json" ;;
  *) echo "unknown part: $part"; exit 2 ;;
esac
