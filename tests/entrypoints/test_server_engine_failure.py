"""The server never dies of one request, on real servers (`random:tiny`) with
faults injected in the engine core's model runner (PAGEDLLM_FAULT_INJECTION):

- a request whose step raises gets its own 500 (400 when the engine calls it invalid) while the
  requests batched with it finish with the output they have alone, and the server goes on
  serving with every KV block back;
- the core process dies (os._exit in a step, SIGKILL): the requests in flight get 503 at once;
  by default the server then exits non-zero by itself; with --restart-engine-on-failure a new
  core serves the next requests.
The same mechanism offline: LLMEngine.step raises RequestFailedError for the culprit alone.
Every wait is bounded and ends on the event it waits for."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from server_utils import RemoteServer, assert_error, assert_exits, wait_idle, wait_session_gone

RAISE, REJECT, EXIT, SLOW = 500, 501, 502, 503  # token ids that trigger each injected fault
FAULTS = f"raise:{RAISE},reject:{REJECT},exit:{EXIT},slow:{SLOW}"
ARGS = ["--model", "random:tiny", "--max-model-len", "1024", "--max-num-seqs", "8"]
# Each step that holds an innocent sleeps 5 ms (`slow`): a tiny model's request of LONG tokens
# then runs for seconds on any machine, long enough for the test to act while it runs.
INNOCENT = [[5, 6, 7, 8, 9, SLOW], [10, 11, 12, SLOW], [13, 14, 15, 16, 17, 18, 19, 20, 21, SLOW]]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = 900  # tokens: a request still running when the test acts (hundreds of steps)


def start_server(extra: list[str]) -> RemoteServer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_FAULT_INJECTION", FAULTS)
        return RemoteServer([*ARGS, *extra], start_timeout=180)


@pytest.fixture(scope="module")
def server():
    srv = start_server(["--restart-engine-on-failure"])
    yield srv
    srv.close()


def complete(client, prompt, max_tokens=40, **kw):
    return client.completions.create(model="random:tiny", prompt=prompt, max_tokens=max_tokens, **GREEDY, **kw)


def post(server, body: dict, timeout=60) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", json={"max_tokens": 8, **body}, timeout=timeout)


def first_chunk_then_rest(server, body: dict, started: threading.Event, out: list) -> None:
    """Stream `body`, set `started` at its first token, then collect the remaining events."""
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        timeout=60,
        json={**body, "stream": True, "temperature": 0, "ignore_eos": True},
    ) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                out.append(line)
                break
        started.set()
        out.extend(line for line in lines if line)


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not {what} after {timeout} s")


def health(server) -> int:
    try:
        return httpx.get(server.url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


# ------------------------------------------------------------------ one request fails, the others go on
@pytest.mark.timeout(240)
def test_poisoned_request_fails_alone(server):
    client = server.client()
    # Long enough that the innocents still run when the poison arrives, even on a loaded machine.
    alone = [complete(client, p, 320).choices[0].text for p in INNOCENT]

    async def together():
        aclient = server.async_client()
        innocents = [
            asyncio.ensure_future(
                aclient.completions.create(model="random:tiny", prompt=p, max_tokens=320, stream=True, **GREEDY)
            )
            for p in INNOCENT
        ]
        streams = await asyncio.gather(*innocents)
        texts = ["" for _ in streams]
        firsts = [await s.__anext__() for s in streams]  # all three are running now
        for i, chunk in enumerate(firsts):
            texts[i] += chunk.choices[0].text
        bad = asyncio.ensure_future(
            aclient.completions.create(model="random:tiny", prompt=[3, RAISE, 4], max_tokens=8, **GREEDY)
        )

        async def rest(i, s):
            async for chunk in s:
                texts[i] += chunk.choices[0].text

        await asyncio.gather(*(rest(i, s) for i, s in enumerate(streams)))
        with pytest.raises(openai.InternalServerError) as e:
            await bad
        await aclient.close()
        return texts, e.value.status_code, e.value.response.json()["error"]

    texts, status, err = asyncio.run(asyncio.wait_for(together(), 180))
    assert status == 500 and err["code"] == "request_failed" and "injected fault" in err["message"], err
    assert texts == alone
    # The poison came while the others were running: a step of several failed and was isolated.
    assert re.search(r"a step of [2-9] request\(s\) failed", server.log_text()), server.log_text()[-3000:]
    wait_idle(server)
    assert complete(client, INNOCENT[0], 320).choices[0].text == alone[0]


@pytest.mark.timeout(180)
def test_failed_request_error_objects(server):
    """Each way a poisoned request can come: a 500 or a 400 object, or an error event in its stream."""
    err = assert_error(post(server, {"prompt": [7, RAISE]}), 500, "request_failed")
    assert "RuntimeError: injected fault" in err["message"]
    err = assert_error(post(server, {"prompt": [7, REJECT]}), 400, "request_failed")
    assert "ValueError: injected fault" in err["message"]
    assert_error(post(server, {"prompt": [7, RAISE], "n": 3, "temperature": 1.0}), 500, "request_failed")
    assert_error(post(server, {"prompt": [[5, 6], [7, RAISE]]}), 500, "request_failed")
    assert_error(post(server, {"prompt": [7, RAISE], "use_beam_search": True, "n": 3}), 500, "request_failed")
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        timeout=60,
        json={"prompt": [7, RAISE], "max_tokens": 8, "stream": True},
    ) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "request_failed" and "injected fault" in error["message"], events
    with pytest.raises(openai.BadRequestError):
        complete(server.client(), [7, REJECT])
    m = wait_idle(server)
    assert m["pagedllm:kv_cache_used_blocks"] == 0
    assert health(server) == 200
    assert complete(server.client(), INNOCENT[1], 4).usage.completion_tokens == 4


# ------------------------------------------------------------------ the core process dies
@pytest.mark.timeout(240)
def test_core_exit_503_then_restarted(server):
    """--restart-engine-on-failure: the core ends itself in a step (os._exit, as a segfault would);
    the request in flight and the one that killed it get 503, then a new core serves."""
    ref = complete(server.client(), INNOCENT[2], 16).choices[0].text
    old_core = server.core_pid()
    started, events = threading.Event(), []
    t = threading.Thread(
        target=first_chunk_then_rest, args=(server, {"prompt": INNOCENT[0], "max_tokens": LONG}, started, events)
    )
    t.start()
    assert started.wait(60), events
    assert_error(post(server, {"prompt": [9, EXIT]}), 503, "engine_dead")
    t.join(60)  # a bound for a hang, not a clock: the stream's end is what is checked
    assert not t.is_alive(), "a stream hung after the core died"
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    wait_until(lambda: health(server) == 200, 120, "serving again")
    assert server.core_pid() != old_core and server.proc.poll() is None
    assert complete(server.client(), INNOCENT[2], 16).choices[0].text == ref
    assert wait_idle(server)["pagedllm:num_requests_running"] == 0
    assert "restarting the engine core" in server.log_text()


@pytest.mark.timeout(240)
def test_core_killed_server_exits_nonzero():
    """By default: the core is SIGKILLed; the requests in flight get 503 at once and the server
    exits 1 within seconds, leaving no process behind (a supervisor restarts it)."""
    srv = start_server([])
    try:
        started, events = threading.Event(), []
        t = threading.Thread(
            target=first_chunk_then_rest, args=(srv, {"prompt": INNOCENT[1], "max_tokens": LONG}, started, events)
        )
        t.start()
        assert started.wait(60), events
        result = {}
        waiter = threading.Thread(
            target=lambda: result.setdefault(
                "r", post(srv, {"prompt": [5, SLOW], "max_tokens": LONG, "ignore_eos": True})
            )
        )
        waiter.start()
        wait_until(lambda: srv.metrics()["pagedllm:num_requests_running"] >= 2, 30, "both running")
        os.kill(srv.core_pid(), signal.SIGKILL)
        t0 = time.monotonic()
        waiter.join(60)
        t.join(60)
        assert not waiter.is_alive() and not t.is_alive(), "a request hung after the core died"
        assert_error(result["r"], 503, "engine_dead")
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
        assert_exits(srv, 1)
        print(f"server exited 1 {time.monotonic() - t0:.1f} s after its core was killed")
        assert "exiting with code 1" in srv.log_text()
        wait_session_gone(srv)
    finally:
        srv.close()


# ------------------------------------------------------------------ offline, the same mechanism
@pytest.mark.timeout(120)
def test_offline_engine_fails_only_the_culprit(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FAULT_INJECTION", FAULTS)
    from pagedllm.engine.output_processor import OutputKind
    from pagedllm.engine.exceptions import RequestFailedError
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(model="random:tiny", max_model_len=128, block_size=4, max_num_seqs=8)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in INNOCENT]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"ok{i}", p, sp, kind=OutputKind.FINAL_ONLY)
    engine.add_request("bad", {"prompt_token_ids": [3, RAISE]}, sp, kind=OutputKind.FINAL_ONLY)
    engine.add_request(
        "bad-n", {"prompt_token_ids": [3, REJECT]}, SamplingParams(n=2, temperature=1.0), kind=OutputKind.FINAL_ONLY
    )
    done, errors = {}, {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        try:
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        except RequestFailedError as e:
            errors.update((rid, e.client_error) for rid in e.req_ids)
    assert errors == {"bad": False, "bad-n": True}
    assert [done[f"ok{i}"] for i in range(3)] == alone
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    with pytest.raises(RequestFailedError, match="injected fault"):
        llm.generate([prompts[0], {"prompt_token_ids": [RAISE]}], sp, use_tqdm=False)
    with pytest.raises(RequestFailedError, match="injected fault"):
        llm.beam_search([{"prompt_token_ids": [RAISE, 4]}, prompts[1]], beam_width=2, max_tokens=4)
    assert llm.generate(prompts[2], sp, use_tqdm=False)[0].outputs[0].token_ids == alone[2]
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
