#!/usr/bin/env bash
# P/D disaggregation benchmarks in one run (about 4-6 minutes on a quiet machine):
#   1. mixed workload (short chats, every 8th request a long prompt) against
#      (a) one colocated instance with chunked prefill, 2 threads, and
#      (b) 1 prefill + 1 decode instance (1 thread each) behind `pagedllm proxy`;
#      -> short-chat ITL p50/p99 (the TBT goal: (b) <= 0.5x (a)), TTFT p50/p99, out tok/s, KV moved;
#   2. (b)'s capacity on that mix (as fast as it goes), then an overload run at 2x that rate through
#      a proxy with --ttft-slo: rejected share, admitted TTFT p99, admitted requests per 10 s.
# Servers run from this source tree on 127.0.0.1 and are stopped at the end (also on error / ^C).
#   bash tools/bench_pd.sh                 # SCALE=full
#   SCALE=small bash tools/bench_pd.sh     # a smoke run (a minute or two)
#   MODEL=/path/to/hf-dir bash tools/bench_pd.sh   # another model (default random:tiny)
#   MODEL=SmolLM2-135M-Instruct KV_CACHE_MEMORY=0.5 MAX_MODEL_LEN=2048 MIXED_PROMPTS=32 MIXED_RATE=2.0 \
#       MIXED_ONLY=1 bash tools/bench_pd.sh      # the default model, the mixed workload only
#   OVERLOAD_ONLY=1 bash tools/bench_pd.sh   # only (b)'s capacity and the overload run (about 3 min)
#   OVERLOAD_ONLY=1 OVERLOAD_RATE=50 ...     # the overload at this rate, no capacity run
# The overload run's proxy writes --trace $OUT/overload_trace.jsonl (predicted vs measured TTFT by
# part, summarised at the end) and the instances' running / waiting requests go to
# $OUT/overload_queues.txt once a second.
# Logs and JSON go to $OUT (default /tmp/pagedllm-bench-pd).
set -euo pipefail
OUT=${OUT:-/tmp/pagedllm-bench-pd}
SCALE=${SCALE:-full}
MODEL=${MODEL:-random:tiny}
PY=${PY:-python}
TTFT_SLO=${TTFT_SLO:-1.5}
BASE_PORT=${BASE_PORT:-8310}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CLI="$PY -m pagedllm.entrypoints.cli"
SERVE_ARGS=(--model "$MODEL" --max-model-len "${MAX_MODEL_LEN:-1024}" --kv-cache-memory "${KV_CACHE_MEMORY:-0.05}")
if [[ $SCALE == small ]]; then
  MIXED=(--num-prompts 16 --random-input-len 24 --random-output-len 16 --long-every 8 --long-input-len 480
         --concurrency 8 --request-rate 4.0)
  CAP_PROMPTS=64 OVERLOAD_S=20
else
  MIXED=(--num-prompts 64 --random-input-len 24 --random-output-len 32 --long-every 8 --long-input-len 960
         --concurrency 16 --request-rate 4.0)
  CAP_PROMPTS=512 OVERLOAD_S=90
fi
MIXED[1]=${MIXED_PROMPTS:-${MIXED[1]}}; MIXED[-1]=${MIXED_RATE:-${MIXED[-1]}}
BENCH=($CLI bench serve --tokenizer "$MODEL" --warmup 2)

PIDS=()
stop_all() {   # each server was started in its own session: signal that group, by its id
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap stop_all EXIT INT TERM

wait_health() {   # URL NAME: bounded (240 s); fails if the process exits
  local url=$1 name=$2 pid=${PIDS[-1]}
  for _ in $(seq 480); do
    curl -sf "$url/health" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$name exited during start-up; its log: $OUT/$name.log"; tail -20 "$OUT/$name.log"; exit 1; }
    sleep 0.5
  done
  echo "$name not ready after 240 s"; exit 1
}

start() {   # NAME THREADS ARGS...: a `pagedllm` command in its own session, logged to $OUT/NAME.log
  local name=$1 threads=$2; shift 2
  echo "+ OMP_NUM_THREADS=$threads pagedllm $*" | tee -a "$OUT/commands.txt"
  OMP_NUM_THREADS=$threads setsid $CLI "$@" >"$OUT/$name.log" 2>&1 &
  PIDS+=($!)
}

bench() {   # NAME URL ARGS...
  local name=$1 url=$2; shift 2
  echo "+ pagedllm bench serve --base-url $url $*" | tee -a "$OUT/commands.txt"
  "${BENCH[@]}" --base-url "$url" --output-json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt"
}

poll_queues() {   # FILE URL...: each instance's running / waiting requests once a second (where the TTFT goes)
  local file=$1; shift
  while :; do
    for u in "$@"; do
      echo "$(date +%s.%N) $u $(curl -s "$u/metrics" | awk '/^pagedllm:num_requests_(running|waiting)/ {printf "%s=%s ", $1, $2}')"
    done >>"$file"
    sleep 1
  done
}

kv_config() { echo "{\"kv_connector\": \"ZmqConnector\", \"kv_role\": \"$1\"}"; }

echo "== uptime before: $(uptime)" | tee "$OUT/uptime.txt"
A=http://127.0.0.1:$BASE_PORT P=http://127.0.0.1:$((BASE_PORT + 1)) D=http://127.0.0.1:$((BASE_PORT + 2))
X=http://127.0.0.1:$((BASE_PORT + 3))

if [[ -z ${OVERLOAD_ONLY:-} ]]; then
# (a) colocated, chunked prefill, 2 threads
start colocated 2 serve --port $BASE_PORT "${SERVE_ARGS[@]}"
wait_health $A colocated
bench mixed_colocated $A "${MIXED[@]}"
stop_all
fi

# (b) 1P + 1D, 1 thread each, behind the proxy
start prefill 1 serve --port $((BASE_PORT + 1)) "${SERVE_ARGS[@]}" --kv-transfer-config "$(kv_config kv_producer)"
wait_health $P prefill
start decode 1 serve --port $((BASE_PORT + 2)) "${SERVE_ARGS[@]}" --kv-transfer-config "$(kv_config kv_consumer)"
wait_health $D decode
start proxy 1 proxy --port $((BASE_PORT + 3)) --prefill $P --decode $D
wait_health $X proxy
if [[ -z ${OVERLOAD_ONLY:-} ]]; then
  bench mixed_pd $X "${MIXED[@]}"
  curl -s $X/metrics | grep -E '^pagedllm_proxy:(kv_blocks_moved_total|requests_total)' | tee "$OUT/mixed_pd_proxy_metrics.txt"
fi

if [[ -n ${MIXED_ONLY:-} ]]; then   # the mixed workload only: the table of (a) vs (b)
  stop_all
  $PY - "$OUT" <<'EOF'
import json, sys
row = lambda name: json.load(open(f"{sys.argv[1]}/{name}.json"))["runs"][0]
a, b = row("mixed_colocated"), row("mixed_pd")
for name, r in (("(a) colocated", a), ("(b) 1P+1D", b)):
    print(f"| {name} | {r['p50_short_itl_ms']:.0f} ms | {r['p99_short_itl_ms']:.0f} ms | {r['p50_ttft_ms']:.0f} ms | "
          f"{r['p99_ttft_ms']:.0f} ms | {r['output_throughput']:.1f} | {r['failed']} |")
print(f"short-chat ITL p99 (b)/(a): {b['p99_short_itl_ms'] / a['p99_short_itl_ms']:.2f}x (goal <= 0.5x)")
EOF
  exit 0
fi

# (b)'s capacity on the mix: as fast as it goes (no request rate), at the decode instance's batch
# limit (128 sequences: a lower concurrency measures the client's cap, not the instances')
if [[ -n ${OVERLOAD_RATE:-} ]]; then   # given: no capacity run
  RATE=$OVERLOAD_RATE
else
  CAP=("${MIXED[@]}")
  CAP[1]=$CAP_PROMPTS; CAP[-1]=inf; CAP[-3]=128
  bench capacity_pd $X "${CAP[@]}"
  RATE=$($PY -c "import json; r = json.load(open('$OUT/capacity_pd.json'))['runs'][0]; print(round(2 * r['request_throughput'], 2))")
fi
N=$($PY -c "print(max(16, int($RATE * $OVERLOAD_S)))")
echo "== overload at $RATE req/s (2x the capacity just measured), $N requests" | tee -a "$OUT/commands.txt"

# Overload at 2x through a proxy with the TTFT SLO (a fresh one: no bookings from the runs above)
kill -TERM -- "-${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'
start proxy_slo 1 proxy --port $((BASE_PORT + 3)) --prefill $P --decode $D --ttft-slo "$TTFT_SLO" \
  --trace "$OUT/overload_trace.jsonl"
wait_health $X proxy_slo
OVER=("${MIXED[@]}")
OVER[1]=$N; OVER[-1]=$RATE; OVER[-3]=512   # concurrency high enough that the client never caps arrivals
poll_queues "$OUT/overload_queues.txt" $P $D &
POLL=$!
bench overload_pd $X "${OVER[@]}" || echo "(bench serve: some requests failed; see the summary)"
kill $POLL 2>/dev/null || true
curl -s $X/metrics | grep -E '^pagedllm_proxy:requests_total' | tee "$OUT/overload_pd_proxy_metrics.txt"
stop_all
echo "== uptime after: $(uptime)" | tee -a "$OUT/uptime.txt"

$PY - "$OUT" "$TTFT_SLO" <<'EOF'
import json, sys
out, slo = sys.argv[1], float(sys.argv[2])
row = lambda name: json.load(open(f"{out}/{name}.json"))["runs"][0]
o = row("overload_pd")
try:
    a, b = row("mixed_colocated"), row("mixed_pd")
except FileNotFoundError:   # OVERLOAD_ONLY
    a = b = None
if a is not None:
    print("\n| | short-chat ITL p50 | short-chat ITL p99 | TTFT p50 | TTFT p99 | out tok/s | failed |")
    print("|---|---|---|---|---|---|---|")
    for name, r in (("(a) colocated", a), ("(b) 1P+1D", b)):
        print(f"| {name} | {r['p50_short_itl_ms']:.0f} ms | {r['p99_short_itl_ms']:.0f} ms | {r['p50_ttft_ms']:.0f} ms | "
              f"{r['p99_ttft_ms']:.0f} ms | {r['output_throughput']:.1f} | {r['failed']} |")
    print(f"\nshort-chat ITL p99 (b)/(a): {b['p99_short_itl_ms'] / a['p99_short_itl_ms']:.2f}x (goal <= 0.5x)")
n = o["completed"] + o["failed"] + o["rejected"]
w = o.get("admitted_per_10s", [])
loaded = w[1:-1]   # the first window fills the pipe, the last is partial
spread = max(abs(x - sum(loaded) / len(loaded)) for x in loaded) / (sum(loaded) / len(loaded)) if loaded else float("nan")
print(f"overload: {o['rejected']} of {n} rejected ({100 * o['rejected'] / max(n, 1):.1f} %), {o['failed']} failed; "
      f"admitted TTFT p50 {o['p50_ttft_ms']:.0f} ms, p99 {o['p99_ttft_ms']:.0f} ms (SLO {slo * 1000:.0f} ms); "
      f"admitted per 10 s {w} (loaded windows within +-{100 * spread:.0f} % of their mean; goal 20 %)")
# Where the admitted TTFT goes (the proxy's --trace): predicted beside measured, seconds
import numpy as np
rs = [json.loads(line) for line in open(f"{out}/overload_trace.jsonl")]
col = lambda *keys: np.sum([[r[k] for r in rs] for k in keys], axis=0)
print("| part | predicted p50 | p99 | measured p50 | p99 |\n|---|---|---|---|---|")
for name, pred, meas in (("prefill (queue + work)", col("pred_queue", "pred_prefill"), col("prefill")),
                         ("decode first token (transfer + slot + steps)",
                          col("pred_transfer", "pred_slot_wait", "pred_step"), col("decode_first")),
                         ("TTFT", col("pred_ttft"), col("ttft"))):
    print(f"| {name} | {np.percentile(pred, 50):.3f} | {np.percentile(pred, 99):.3f} | "
          f"{np.percentile(meas, 50):.3f} | {np.percentile(meas, 99):.3f} |")
print(f"tail margin (p99 of recent errors at the lowest loads, counted up to SLO/2) p50 "
      f"{np.percentile(col('margin'), 50):.3f} s, + at the request's load p50 {np.percentile(col('load_margin'), 50):.3f}, "
      f"p99 {np.percentile(col('load_margin'), 99):.3f} s; decode load at send p50 "
      f"{np.percentile(col('position'), 50):.0f}, p99 {np.percentile(col('position'), 99):.0f}")
# The admitted TTFT by the decode load at admission (where the tail comes from)
load, ttft = col("load"), col("ttft")
print("| load at admission | admitted | TTFT p50 | p99 | over the SLO |\n|---|---|---|---|---|")
for lo in range(0, int(load.max()) + 1, 32):
    m = (load > lo) & (load <= lo + 32)
    if m.any():
        print(f"| {lo + 1}-{lo + 32} | {m.sum()} | {np.percentile(ttft[m], 50):.3f} | {np.percentile(ttft[m], 99):.3f} | "
              f"{100 * (ttft[m] > slo).mean():.1f} % |")
targets = [r["target"] for r in rs if r.get("target") is not None]
if targets:   # SloFeedback: the TTFT the admission held predictions to, over the run
    print(f"admission target (SLO x factor) min {min(targets):.3f} s, p50 {np.percentile(targets, 50):.3f} s, "
          f"last {targets[-1]:.3f} s")
limits = [r["limit"] for r in rs if "limit" in r]
if limits:   # LoadLimit: the decode load admitted at most, over the run
    print(f"decode load limit min {min(limits):.0f}, p50 {np.percentile(limits, 50):.0f}, max {max(limits):.0f}, "
          f"last {limits[-1]:.0f}; over the SLO in the first 10 s: "
          f"{sum(1 for r in rs if r['t0'] - rs[0]['t0'] < 10 and r['ttft'] > slo)}")
if "front" in rs[0]:   # the proxy's own front: arrival in its app -> admission decided
    print(f"proxy front (arrival -> admitted) p50 {np.percentile(col('front'), 50) * 1000:.1f} ms, "
          f"p99 {np.percentile(col('front'), 99) * 1000:.1f} ms")
EOF
