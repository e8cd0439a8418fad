"""`python -m pagedllm.distributed.comm_bench`: what one collective costs here (Gloo over
loopback, 2 processes, 1 thread each), for the shapes tensor parallelism sends per layer
(an all-reduce of [tokens, hidden] float32) and the logits gather; with the model's 30
layers x 2 all-reduces + 1 (embedding) per step this gives the communication floor per step."""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, port: int, hidden: int, vocab: int, tokens: list[int], reps: int, out) -> None:
    torch.set_num_threads(1)
    from pagedllm.distributed.parallel_state import make_backend

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = make_backend(store, "bench", rank, 2, "127.0.0.1", datetime.timedelta(seconds=60))
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden)
        for _ in range(3):
            pg.allreduce([x]).wait()
        t0 = time.perf_counter()
        for _ in range(reps):
            pg.allreduce([x]).wait()
        ar = (time.perf_counter() - t0) / reps
        logits = torch.randn(min(t, 256), vocab // 2)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        for _ in range(max(reps // 4, 2)):
            if rank == 0:
                pg.gather([[torch.empty_like(logits), torch.empty_like(logits)]], [logits], opts).wait()
            else:
                pg.gather([], [logits], opts).wait()
        ga = (time.perf_counter() - t0) / max(reps // 4, 2)
        rows.append((t, ar, ga, min(t, 256)))
    if rank == 0:
        out.put(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 2048])
    p.add_argument("--reps", type=int, default=50)
    ns = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    s = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    port = s.port
    del s
    procs = [ctx.Process(target=_run, args=(r, port, ns.hidden, ns.vocab, ns.tokens, ns.reps, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=600)
    for pr in procs:
        pr.join(60)
    n_ar = 2 * ns.layers + 1
    print(
        f"Gloo, 2 processes on 127.0.0.1, float32, hidden {ns.hidden}; per step: {n_ar} all-reduces "
        f"of [tokens, hidden] + 1 gather of [sampled rows, vocab/2]"
    )
    print(f"{'tokens':>7} {'all-reduce':>11} {'MB/s':>7} {'x' + str(n_ar) + ' per step':>15} {'gather (rows)':>16}")
    for t, ar, ga, r in rows:
        mbps = t * ns.hidden * 4 / ar / 1e6
        print(f"{t:>7} {ar * 1e6:>9.0f}µs {mbps:>7.0f} {ar * n_ar * 1e3:>12.2f} ms {ga * 1e3:>10.2f} ms ({r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
