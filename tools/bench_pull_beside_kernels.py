"""KV pulls beside a busy step loop, in one process (docs/history/benchmarks.md, 2026-11-23 22:35 UTC).

The main thread calls the C++ `linear_small` kernel back to back (one torch thread, a step's
kernels) while 4 pool threads pull 2-block requests over ZMQ from a `KVServer` thread (a
kv_both instance: the producer's and the consumer's threads both contend with the kernels).
Prints the pulls per second and their latency. With kernels that hold the GIL (df1af55's
csrc/bindings.cpp) the pulls crawl; with kernels that release it they run at ZMQ's pace.

    PYTHONPATH=. .venv/bin/python tools/bench_pull_beside_kernels.py [--pulls 40]
"""

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zmq

from pagedllm.distributed.kv_transfer.zmq_transport import KVServer, pull_kv
from pagedllm.models.cpu_ops import cpu_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pulls", type=int, default=40)
    ap.add_argument("--port", type=int, default=8395)
    args = ap.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the C++ kernels did not build")
    torch.set_num_threads(1)
    layers, block, heads, dim = 2, 16, 4, 32  # random:tiny's cache shape

    def caches():  # [4096 blocks * block, heads, dim] K and V per layer
        return [(torch.randn(4096 * block, heads, dim), torch.randn(4096 * block, heads, dim)) for _ in range(layers)]

    src, dst = caches(), caches()
    server = KVServer("127.0.0.1", args.port, src, block, 30.0)
    reqs = {f"r{i}": [2 * i, 2 * i + 1] for i in range(args.pulls)}
    server.expect(reqs)
    server.layer_done(layers - 1, list(reqs))
    ctx = zmq.Context()
    w, x = torch.randn(2048, 4096), torch.randn(8, 4096)

    def pull(i: int) -> float:
        t = time.perf_counter()
        pull_kv(ctx, "127.0.0.1", args.port, f"r{i}", 0, reqs[f"r{i}"], dst, block, 30.0, False)
        return time.perf_counter() - t

    calls, t0 = 0, time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(pull, i) for i in range(args.pulls)]
        while not all(f.done() for f in futures):
            ops.linear_small(x, w, None)
            calls += 1
        latency = np.array([f.result() for f in futures])
    wall = time.perf_counter() - t0
    t = time.perf_counter()
    ops.linear_small(x, w, None)
    call = time.perf_counter() - t
    server.shutdown()
    print(
        f"{ops.__name__}: one kernel call {call * 1e3:.1f} ms; {args.pulls} pulls in {wall:.2f} s "
        f"({args.pulls / wall:.0f}/s), latency p50 {np.median(latency) * 1e3:.1f} ms, "
        f"p99 {np.percentile(latency, 99) * 1e3:.1f} ms; {calls} kernel calls meanwhile"
    )


if __name__ == "__main__":
    main()
