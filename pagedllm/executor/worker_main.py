"""`python -m pagedllm.executor.worker_main FD`: an mp worker process.

Workers start from this module, not from the driver's `__main__` (multiprocessing's spawn
re-runs the script that made the engine, which fails for `python -c` or a script read from
stdin and re-runs unguarded top-level code). FD is the worker's end of a socket pair with the
driver; the first message on it is run_worker_process's arguments.
"""
from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    kwargs = conn.recv()
    from pagedllm.executor.worker import run_worker_process   # after the fd is ours: torch is slow to import
    run_worker_process(conn=conn, **kwargs)


if __name__ == "__main__":
    main()
