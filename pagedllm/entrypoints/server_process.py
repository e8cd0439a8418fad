"""An HTTP server as a child process: started in a session of its own (so that stopping it stops
its engine-core processes too), waited for until /health answers, stopped with SIGTERM, then
SIGKILL. Used by the proxy's Ray launcher, by the benchmarks that start servers to load them, and
by the tests' RemoteServer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL when its parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ServerProcess:
    def __init__(
        self,
        cmd: list,
        url: str,
        env: dict | None = None,
        name: str = "server",
        die_with_parent: bool = False,
        cwd: str | None = None,
    ) -> None:
        self.url, self.name = url, name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"pagedllm-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
            env=dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1"),
        )

    def wait_ready(self, timeout: float) -> None:
        """Returns once the server answers /health; RuntimeError with its log if it exits or is
        not ready within `timeout` seconds (it is stopped then)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} at {self.url}: the server exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tail = self.log_tail()
        self.stop(0)
        raise RuntimeError(f"{self.name} at {self.url}: not ready after {timeout} s:\n{tail}")

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the server's session, SIGKILL after `timeout`; the log is removed. -> its exit code."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the session is left
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        return self.proc.returncode
