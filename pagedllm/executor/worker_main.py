"""`python -m pagedllm.executor.worker_main FD`: an mp worker process.

Workers start from this module, not from the driver's `__main__` (multiprocessing's spawn
re-runs the script that made the engine, which fails for `python -c` or a script read from
stdin and re-runs unguarded top-level code). FD is the worker's end of a socket pair with the
driver; the first message on it is run_worker_process's arguments.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

# The calls of a step: not answered (a failure shows in the driver's next collective).
STEP_CALLS = ("execute_model_worker", "finish_step_worker")


def run_worker_process(conn, log_level: int, **worker_kwargs) -> None:
    """The loop of an mp worker process around a worker.worker.Worker(**worker_kwargs).
    Messages on `conn` are (method, args); every one but STEP_CALLS is answered with
    ("ok", result). A failure is sent as ("error", text) and ends the process; the driver's next
    collective fails at once, and it reports the text. The process also ends when the driver
    is gone (its end of the socket closes, or the parent process changes)."""
    from pagedllm.worker.worker import Worker  # after the fd is ours: torch is slow to import

    rank = worker_kwargs["rank"]
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    parent = os.getppid()
    worker = Worker(**worker_kwargs)
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    return
                continue
            method, args = conn.recv()
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method not in STEP_CALLS:
                conn.send(("ok", result))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the driver is gone or ended us
    except BaseException:
        text = f"worker rank {rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}"
        logger.error("%s", text)
        try:
            conn.send(("error", text))
        except Exception:
            pass
        sys.exit(1)
    finally:
        worker.shutdown()
    try:
        conn.send(("ok", None))  # the shutdown is done
    except Exception:
        pass


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    run_worker_process(conn=conn, **conn.recv())


if __name__ == "__main__":
    main()
