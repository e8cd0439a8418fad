"""A real `pagedllm serve` in a subprocess on 127.0.0.1 (a free port), for the server tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

import httpx

from pagedllm.entrypoints.server_process import ServerProcess, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _proc_stats():
    """(pid, fields of /proc/PID/stat after the command name) of every live process."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(d), stat[stat.rindex(")") + 2 :].split()


def session_pids(sid: int) -> list[int]:
    """Live processes of a session (the server started its own)."""
    return [pid for pid, fields in _proc_stats() if int(fields[3]) == sid and fields[0] != "Z"]


def child_pids(pid: int) -> list[tuple[int, str]]:
    out = []
    for child, fields in _proc_stats():
        if int(fields[1]) != pid:
            continue
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                out.append((child, f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


class RemoteServer(ServerProcess):
    """`pagedllm serve ARGS` from the repository, ready when constructed; the tests' view of it
    (clients, /metrics, the engine core's pid, the whole log)."""

    def __init__(
        self, args: list[str], api_key: Optional[str] = None, start_timeout: float = 300.0, env: Optional[dict] = None
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-stats-interval",
            "1",
            *args,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        environ = dict(os.environ)
        for name in ("PAGEDLLM_API_KEY", "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"):  # the tests' servers are open
            environ.pop(name, None)
        environ.update(env or {})  # the server's own variables (envs.py), for a test of them
        super().__init__(cmd, f"http://127.0.0.1:{self.port}", environ, cwd=REPO)
        self.wait_ready(start_timeout)  # RuntimeError with the log's tail if it exits or hangs

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai

        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("timeout", 120)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value, and the bare name of a single-series metric -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            out[name + labels] = value
            labels_wo_model = re.sub(r'model_name="[^"]*",?', "", labels).replace(",}", "}")
            out[name + ("" if labels_wo_model in ("{}", "") else labels_wo_model)] = value
        return out

    def core_pid(self) -> int:
        """The engine core: the server's one live child besides multiprocessing's resource tracker
        (a core that died, not yet reaped, has no command line)."""
        pids = [p for p, cmd in child_pids(self.proc.pid) if cmd and "resource_tracker" not in cmd]
        assert len(pids) == 1, child_pids(self.proc.pid)
        return pids[0]

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """Last resort (teardown): the whole session, by its id."""
        for pid in session_pids(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.log.close()
        keep = os.environ.get("PAGEDLLM_TEST_SERVER_LOG")  # debugging: keep the server's log
        if keep:
            with open(keep, "a") as f:
                f.write(self.log_text())
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


TINY = "random:tiny"
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # it has none of its own


def tiny_server(max_model_len: int, *args: str, env: Optional[dict] = None) -> RemoteServer:
    """A server of the tiny random-weight model (quick to start), with a plain chat template."""
    return RemoteServer(
        [
            "--model",
            TINY,
            "--max-model-len",
            str(max_model_len),
            "--kv-cache-memory",
            "0.01",
            "--chat-template",
            TINY_CHAT_TEMPLATE,
            *args,
        ],
        env=env,
    )


# The two servers the test session shares (conftest.py: `default_server`, `tiny_shared_server`)
# among the modules that need no flag of their own: starting one (a core process, the model,
# the C++ kernels) costs more than most of the tests run on it.
DEFAULT_SERVER_MAX_MODEL_LEN = 1024
DEFAULT_SERVER_ARGS = [
    "--max-model-len",
    str(DEFAULT_SERVER_MAX_MODEL_LEN),
    "--kv-cache-memory",
    "0.25",
    "--max-num-seqs",
    "64",
]
# Each step that holds a request whose prompt has " dragon" (token 17422 of the default model's
# tokenizer) sleeps LONG_STEP_MS (PAGEDLLM_FAULT_INJECTION's `slow`): the disconnect tests' long
# requests then outlast any stall of the client (hundreds of steps), and end at the disconnect.
LONG_PROMPT = "Tell me a long story about a dragon."
LONG_STEP_TOKEN, LONG_STEP_MS = 17422, 50
DEFAULT_SERVER_ENV = {
    "PAGEDLLM_FAULT_INJECTION": f"slow:{LONG_STEP_TOKEN}:{LONG_STEP_MS}",
    "PAGEDLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
}
# The Responses store is off unless asked for (as vLLM's): on for the shared tiny and tool servers.
RESPONSES_STORE_ON = {"PAGEDLLM_ENABLE_RESPONSES_API_STORE": "1"}
TINY_SERVER_MAX_MODEL_LEN = 64
TINY_SERVER_MAX_BODY_BYTES = 64 << 10  # small, for test_input_bounds.py's 413s


def assert_error(r: httpx.Response, status: int, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def wait_metrics(server, condition, what: str, timeout: float = 60.0) -> dict:
    """Poll /metrics until condition(metrics) holds -> the metrics. The bound is generous: a
    slow machine waits longer, it does not change the verdict."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if condition(m):
            return m
        if time.monotonic() > deadline:
            # the gauges and request counts first: a long dump gets cut where CI shows it
            key = {
                k: v
                for k, v in m.items()
                if "_num_requests" in k or "kv_cache_used" in k or "request_success_total" in k
            }
            raise AssertionError(f"{what}: not after {timeout} s: {key}; all: {m}")
        time.sleep(0.05)


ABORTED = 'pagedllm:request_success_total{finished_reason="abort"}'


@contextlib.contextmanager
def core_frozen(server):
    """The engine core stopped (SIGSTOP) for the block, the API process running: no step, so no
    token, is made meanwhile. What a test does inside (a disconnect, an abort) comes before the
    request's next token however fast the machine is; /metrics still answers (the API process
    serves it), showing what the core last reported."""
    pid = server.core_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # the server stopped it meanwhile
            pass


def wait_aborted(server, before: dict) -> dict:
    """Wait until the API process has counted one more aborted request than `before` (it counts
    when it aborts, before the core hears of it: this works with the core frozen)."""
    return wait_metrics(server, lambda m: m[ABORTED] > before[ABORTED], "the API server aborted the request")


def disconnect_when(server, path: str, body: dict, condition, what: str) -> None:
    """POST body (not streamed) and, once condition(metrics) holds, close the connection with the
    core frozen, and wait until the API server has aborted the request: the request cannot end
    (and its end cannot overtake the abort) between the moment seen and the disconnect."""
    import asyncio

    async def run():
        before = server.metrics()
        async with httpx.AsyncClient(timeout=120) as c:
            call = asyncio.create_task(c.post(server.url + path, json=body, headers=server.headers()))
            await asyncio.to_thread(wait_metrics, server, condition, what)
            with core_frozen(server):
                assert not call.done(), f"the request ended before the disconnect: {call.result()}"
                call.cancel()  # closes the connection mid-request
                try:
                    await call
                except asyncio.CancelledError:
                    pass
                await asyncio.to_thread(wait_aborted, server, before)

    asyncio.run(run())


def wait_idle(server, timeout=60.0) -> dict:
    """Poll /metrics until no KV block is used and nothing runs or waits -> the metrics."""
    return wait_metrics(
        server,
        lambda m: (
            m["pagedllm:kv_cache_used_blocks"] == 0
            and m["pagedllm:num_requests_running"] == 0
            and m["pagedllm:num_requests_waiting"] == 0
        ),
        "blocks freed, nothing running or waiting",
        timeout,
    )


def assert_exits(server, code: int, timeout: float = 30.0) -> None:
    """The server process exits by itself with `code` (a bound for a hang, not a clock)."""
    try:
        got = server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within {timeout} s") from None
    assert got == code, server.log_text()[-3000:]


def wait_session_gone(server, timeout=60.0) -> None:
    """Wait until no process of the server's session is left (the server, its engine core)."""
    deadline = time.monotonic() + timeout
    while session_pids(server.proc.pid):
        assert time.monotonic() < deadline, f"processes left behind: {session_pids(server.proc.pid)}"
        time.sleep(0.1)
