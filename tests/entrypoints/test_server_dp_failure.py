"""A data-parallel replica dies on a real server (`pagedllm serve -dp 2` on random:tiny): one
replica's engine-core process is SIGKILLed while both replicas run a request. As documented
(engine/dp_client.py), a dead replica takes the server's engine down as one core's death does:
the requests in flight on either replica end with an error at once, and the server exits 1 by
itself leaving no process behind. Every wait is bounded and ends on the event it waits for."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from server_utils import RemoteServer, assert_exits, child_pids, wait_metrics, wait_session_gone
from test_server_engine_failure import SLOW, first_chunk_then_rest

LONG = 900  # tokens, each step slowed 5 ms by the `slow` fault: running for seconds on any machine


def core_pids(srv) -> list[int]:
    return [p for p, cmd in child_pids(srv.proc.pid) if cmd and "resource_tracker" not in cmd]


@pytest.mark.timeout(240)
def test_replica_killed_requests_fail_and_server_exits():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_FAULT_INJECTION", f"slow:{SLOW}")
        srv = RemoteServer(["--model", "random:tiny", "--max-model-len", "1024", "-dp", "2"], start_timeout=180)
    try:
        cores = core_pids(srv)
        assert len(cores) == 2, child_pids(srv.proc.pid)
        streams = []
        for prompt in ([5, 6, 7, SLOW], [10, 11, 12, 13, SLOW]):
            started, events = threading.Event(), []
            t = threading.Thread(
                target=first_chunk_then_rest, args=(srv, {"prompt": prompt, "max_tokens": LONG}, started, events)
            )
            t.start()
            assert started.wait(60), events
            streams.append((t, events))
        # the router sends the second request to the idle replica: each replica runs one
        m = wait_metrics(srv, lambda m: m["pagedllm:num_requests_running"] >= 2, "both running")
        assert [m.get(f'pagedllm:dp_replica_requests_added{{replica="{i}"}}', 0) for i in range(2)] == [1, 1], m
        os.kill(cores[1], signal.SIGKILL)
        for t, events in streams:
            t.join(60)  # a bound for a hang, not a clock: the stream's end is what is checked
            assert not t.is_alive(), "a stream hung after a replica died"
            assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
        assert_exits(srv, 1)
        wait_session_gone(srv)
    finally:
        srv.close()
