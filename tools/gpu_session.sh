#!/usr/bin/env bash
# Every GPU check of the GPU-path issue in one run, for a machine lent for a short time (it has
# torch, triton and transformers; the project runs from the source tree, nothing is installed).
# Logs and JSON go to $OUT (the device tool brings that folder back). Models are made here with
# random weights (models/random_model.py); nothing is downloaded.
#   bash tools/gpu_session.sh            # all: tests, kernel bandwidth, TPOT, throughput
#   bash tools/gpu_session.sh tests      # some parts: tests attention latency async throughput profile256
# pytest may be missing there and the machine has no network: `make gpu-wheels` here puts its
# wheels in tools/wheels (ignored by git); carry that folder with the call.
set -u
OUT=${OUT:-/tmp/pagedllm-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PAGEDLLM_HOME="${PAGEDLLM_HOME:-/tmp/pagedllm-home}"
BENCH="python -m pagedllm.entrypoints.cli bench"
MODEL="--model random:llama-3.2-1b --max-model-len 4096"
parts=" ${*:-all} "
want() { [[ $parts == *" all "* || $parts == *" $1 "* ]]; }   # several parts in one call: `tests async`
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/device.txt"
python -c "import pytest" 2>/dev/null || pip install -q --no-index --find-links tools/wheels pytest pytest-timeout
run() { echo "+ $*" | tee -a "$OUT/commands.txt"; "$@"; }
if want tests; then
  run python -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -30 | tee "$OUT/test_gpu.log"
fi
if want attention; then
  run $BENCH attention --cuda-graph --batch-size 1 8 32 128 --context-len 1024 4096 16384 \
    --output-json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
fi
if want latency; then
  run $BENCH latency $MODEL --batch-size 1 --input-len 128 --output-len 256 --compare-enforce-eager \
    --torch-profile 20 --output-json "$OUT/latency.json" 2>&1 | tail -60 | tee "$OUT/latency.log"
fi
if want async; then
  # Batch-1 TPOT with and without --async-scheduling (one engine after the other, same batches).
  run $BENCH latency $MODEL --batch-size 1 --input-len 128 --output-len 256 --async-scheduling \
    --compare-async-scheduling --profile --output-json "$OUT/latency_async.json" 2>&1 | tail -60 | tee "$OUT/latency_async.log"
fi
if want throughput; then
  run $BENCH throughput $MODEL --max-num-seqs 256 --num-prompts 512 --hf-batch-size 64 \
    --output-json "$OUT/throughput.json" 2>&1 | tail -20 | tee "$OUT/throughput.log"
fi
if want profile256; then
  # Where a batch-256 decode step goes: torch.profiler over 20 steps of 256 requests (kernels in
  # the graphs included), and the engine's phases, with and without async scheduling.
  for flag in "" --async-scheduling; do
    run $BENCH latency $MODEL --max-num-seqs 256 --batch-size 256 --input-len 128 --output-len 128 $flag \
      --profile --torch-profile 20 --torch-profile-batch 256 --output-json "$OUT/profile256${flag//-/_}.json" 2>&1 \
      | tail -80 | tee "$OUT/profile256${flag//-/_}.log"
  done
  run $BENCH throughput $MODEL --max-num-seqs 256 --num-prompts 512 --hf-batch-size 64 --async-scheduling \
    --output-json "$OUT/throughput_async.json" 2>&1 | tail -20 | tee "$OUT/throughput_async.log"
fi
