#!/usr/bin/env bash
# Every GPU check of the GPU path in one run, for a machine lent for a short time (it has torch,
# triton, transformers and pytest; the project runs from the source tree, nothing is installed).
# Logs and JSON go to $OUT (the device tool brings that folder back). Models are made here with
# random weights (models/random_model.py); nothing is downloaded. Each part has a time limit, so
# that one that hangs leaves the others their time.
#   bash tools/gpu_session.sh tests async                    # ~5 minutes on an H100
#   bash tools/gpu_session.sh throughput profile256 attention  # ~5 minutes: a second call on the warm machine
# (all parts at once outlast the device tool's 10-minute limit for one command).
# Python packages the machine lacks (msgspec) travel as wheels: `make gpu-wheels` here puts them in
# tools/wheels (ignored by git); carry that folder with the call.
set -u
OUT=${OUT:-/tmp/pagedllm-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PAGEDLLM_HOME="${PAGEDLLM_HOME:-/tmp/pagedllm-home}"
export PYTHONUNBUFFERED=1
BENCH="python -m pagedllm.entrypoints.cli bench"
MODEL="--model random:llama-3.2-1b --max-model-len 4096"
parts=" ${*:-all} "
want() { [[ $parts == *" all "* || $parts == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/device.txt"
for pkg in msgspec pytest; do
  python -c "import $pkg" 2>/dev/null || python -m pip install -q --no-index --no-deps --target /tmp/site tools/wheels/*.whl
done
export PYTHONPATH="$PYTHONPATH:/tmp/site"
run() { echo "+ $*" | tee -a "$OUT/commands.txt"; timeout "$LIMIT" "$@"; echo "(exit $?)"; }
# The 1B model's random weights are made once, on the CPU, beside the tests.
python -c "from pagedllm.models.random_model import random_model_dir as d; d('random:llama-3.2-1b')" \
  > "$OUT/make_model.log" 2>&1 &
if want tests; then
  # Every Triton kernel on the device against references without it (several processes: the
  # compiles are the CPU's work), beside the engines on the GPU in one process (float32 greedy =
  # transformers; graphs of decode and mixed steps; Gemma 3, Mixtral, MTP, fp8 KV, DeepSeek-V3).
  python -c "import xdist" 2>/dev/null && XDIST="-n 8" || XDIST=""
  LIMIT=240 run python -m pytest -q -p no:cacheprovider --timeout 120 -rfEs $XDIST \
    tests/test_gpu_kernels.py tests/attention/test_triton_layer_ops.py tests/attention/test_mla_attention.py \
    tests/models/test_moe_layer.py::test_triton_grouped_kernel_equals_torch_path > "$OUT/tests_kernels.log" 2>&1 &
  # One process: the memory-profiling tests need the device to themselves (~190 s beside the kernels' compiles).
  LIMIT=420 run python -m pytest -q -p no:cacheprovider --timeout 120 -rfEs --durations 10 tests/test_gpu.py \
    tests/models/test_deepseek_v3.py::test_greedy_equals_transformers_on_gpu > "$OUT/tests_engine.log" 2>&1
  wait
  tail -n 40 "$OUT/tests_kernels.log" "$OUT/tests_engine.log"
fi
wait
if want async; then
  # Batch-1 TPOT with and without --async-scheduling (one engine after the other, same batches).
  LIMIT=150 run $BENCH latency $MODEL --batch-size 1 --input-len 128 --output-len 256 --async-scheduling \
    --compare-async-scheduling --profile --output-json "$OUT/latency_async.json" 2>&1 | tail -50 | tee "$OUT/latency_async.log"
fi
if want throughput; then
  # Offline throughput against transformers on the same GPU (static batches of 64), then the same
  # requests with graphs of decode steps only: what the mixed-step graphs are worth.
  LIMIT=150 run $BENCH throughput $MODEL --max-num-seqs 256 --num-prompts 512 --hf-batch-size 64 --hf-num-prompts 256 \
    --async-scheduling --output-json "$OUT/throughput.json" 2>&1 | tail -20 | tee "$OUT/throughput.log"
  LIMIT=60 run $BENCH throughput $MODEL --max-num-seqs 256 --num-prompts 512 --skip-hf --async-scheduling \
    --cudagraph-mode FULL_DECODE_ONLY --output-json "$OUT/throughput_decode_graphs.json" 2>&1 | tail -12 \
    | tee "$OUT/throughput_decode_graphs.log"
fi
if want profile256; then
  # Where a batch-256 decode step goes: torch.profiler over 20 steps of 256 requests (kernels in
  # the graphs included), and the engine's phases.
  LIMIT=90 run $BENCH latency $MODEL --max-num-seqs 256 --batch-size 256 --input-len 128 --output-len 128 \
    --async-scheduling --profile --torch-profile 20 --torch-profile-batch 256 --output-json "$OUT/profile256.json" 2>&1 \
    | tail -70 | tee "$OUT/profile256.log"
fi
if want attention; then
  LIMIT=90 run $BENCH attention --cuda-graph --batch-size 1 8 32 128 --context-len 1024 4096 16384 \
    --output-json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
fi
