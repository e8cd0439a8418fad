"""P/D disaggregation end to end: a prefill and a decode `pagedllm serve` (separate processes,
the ZMQ connector) behind `pagedllm proxy` answer greedy requests exactly as one colocated
offline engine does, token for token, streamed and not; the prefill side hits its prefix cache,
the decode side (a cache too small for the batch) preempts and recomputes; a consumer that
never fetches lets the producer's blocks go after the timeout; a producer killed while the
decode instance is pulling turns into an error for that request, no hang, no leaked blocks; a
decode instance killed while pulling leaves no block held on the producer; one killed while it
streams through the proxy ends the client's stream with an error event; an unreachable prefill
instance is a 502.

The tiny random model keeps it fast (prompts as token ids: its tokenizer is word level)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pagedllm import LLM, SamplingParams
from server_utils import REPO, TINY, assert_error, free_port, session_pids, tiny_server, wait_metrics

MAX_LEN, MAX_TOKENS, NUM_PROMPTS = 256, 24, 6
USED = "pagedllm:kv_cache_used_blocks"


def _kv_config(role: str, timeout_s: float) -> str:
    return json.dumps(
        {"kv_connector": "ZmqConnector", "kv_role": role, "kv_connector_extra_config": {"timeout_s": timeout_s}}
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (40,), generator=g).tolist()  # a common prefix: prefill cache hits
    return [
        shared + torch.randint(3, 512, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(NUM_PROMPTS)
    ]


class Proxy:
    def __init__(self, prefill: str, decode: str, *args: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "proxy",
                "--port",
                port,
                "--prefill",
                prefill,
                "--decode",
                decode,
                *args,
            ],
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def servers():
    # The decode instance's cache holds 9 blocks (16 KiB each). The prompts (45-59 tokens, 3-4
    # blocks) fit two at a time, their outputs (69-83 tokens, 5-6 blocks) never two: any two
    # requests in the decode instance at once are both admitted and one is preempted as they grow,
    # whatever the order they come in (with 53-99-token prompts only some pairs fitted, and an
    # order that never put two such side by side preempted nothing). Both instances start at once
    # (each start mostly waits on imports and the model).
    with ThreadPoolExecutor(2) as pool:
        starts = [
            pool.submit(tiny_server, MAX_LEN, "--kv-transfer-config", _kv_config("kv_producer", 4.0)),
            pool.submit(
                tiny_server,
                MAX_LEN,
                "--kv-transfer-config",
                _kv_config("kv_consumer", 3.0),
                "--kv-cache-memory",
                "0.00015",
            ),
        ]
        started = [f.result() for f in starts if f.exception() is None]
    proxy = None
    try:
        if len(started) < 2:
            raise next(f.exception() for f in starts if f.exception() is not None)
        prefill, decode = started
        proxy = Proxy(prefill.url, decode.url)
        yield prefill, decode, proxy
    finally:
        if proxy is not None:
            proxy.close()
        for srv in started:
            srv.close()


def _reference(prompts):
    llm = LLM(TINY, max_model_len=MAX_LEN)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, skip_special_tokens=False),
        use_tqdm=False,
    )
    return [o.outputs[0].text for o in outs]


async def _one(url: str, prompt: list[int], stream: bool) -> str:
    body = {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "skip_special_tokens": False,
    }
    async with httpx.AsyncClient(timeout=120) as c:
        if not stream:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text


@pytest.mark.timeout(600)
def test_proxy_greedy_equals_colocated(servers):
    prefill, decode, proxy = servers
    prompts = _prompts()
    want = _reference(prompts)

    async def run():
        return await asyncio.gather(*[_one(proxy.url, p, stream=i % 2 == 1) for i, p in enumerate(prompts)])

    got = asyncio.run(run())
    assert got == want
    pm, dm = prefill.metrics(), decode.metrics()
    assert pm["pagedllm:prefix_cache_hits_total"] > 0, pm  # the shared prefix, after the first
    assert dm["pagedllm:num_preemptions_total"] > 0, dm  # the decode cache is too small for all
    # Every transfer ended: both sides hold no block (the prefill's are fetched, not leaked).
    wait_metrics(prefill, lambda m: m[USED] == 0, "prefill blocks freed after the fetches", timeout=30)
    wait_metrics(decode, lambda m: m[USED] == 0, "decode blocks freed", timeout=30)
    pm = httpx.get(proxy.url + "/metrics").text
    assert 'pagedllm_proxy:requests_total{outcome="ok"} 6.0' in pm, pm


@pytest.mark.timeout(300)
def test_load_limit_refuses_streams_above_it(servers):
    """With --ttft-slo, a cold proxy's decode load limit (16: its slow start's first value, above
    half of `--decode-max-num-seqs 8`) refuses at once, with a 503 OpenAI error naming it, the
    streamed requests that would take the decode instance beyond 16 streams + pending, though the
    prediction (a 60 s SLO) admits every one; non-streamed requests are not limited (no first token
    to learn from, no TTFT to hold); /metrics reports the limit. The official client, a burst of 40."""
    import openai

    prefill, decode, _ = servers
    proxy = Proxy(prefill.url, decode.url, "--ttft-slo", "60", "--decode-max-num-seqs", "8")
    try:

        async def burst(stream: bool) -> list:
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=240)

            async def one(i: int):
                try:
                    out = await client.completions.create(
                        model=TINY, prompt=[5 + i, 6, 7, 8], max_tokens=4, temperature=0, stream=stream
                    )
                    if stream:
                        async for _ in out:
                            pass
                except openai.APIStatusError as e:
                    return e
                return None

            try:
                return await asyncio.gather(*[one(i) for i in range(40)])
            finally:
                await client.close()

        refused = [e for e in asyncio.run(burst(True)) if e is not None]
        assert 0 < len(refused) <= 24, refused
        for e in refused:
            assert e.status_code == 503 and e.body["code"] == "server_overloaded" and "limit 16" in e.body["message"], e
        assert not any(asyncio.run(burst(False)))
        assert (
            f'pagedllm_proxy:decode_load_limit{{instance="{decode.url}"}} 16.0'
            in httpx.get(proxy.url + "/metrics").text
        )
    finally:
        proxy.close()


@pytest.mark.timeout(120)
def test_slo_refusal(servers):
    """A TTFT SLO no request can meet (1 ms), once the proxy has learned what requests take from
    a few served one at a time (an idle pair admits whatever is predicted), and while the decode
    instance streams an answer: each further request is refused at once with a 503 OpenAI error
    giving the prediction and the SLO (the official client), counted as rejected."""
    import openai

    prefill, decode, _ = servers
    proxy = Proxy(prefill.url, decode.url, "--ttft-slo", "0.001")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        for i in range(4):  # one at a time (an idle pair admits them): the prediction learns what they took
            list(client.completions.create(model=TINY, prompt=[20 + i, 6, 7, 8], max_tokens=4, stream=True))
        busy = client.completions.create(
            model=TINY, prompt=[5, 6, 7], max_tokens=100, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(busy))  # its first chunk: the decode instance is streaming it
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                out = client.completions.create(model=TINY, prompt=[9, 10, 11, 12], max_tokens=4, stream=stream)
                list(out) if stream else None
            err = e.value
            assert err.status_code == 503 and err.body["code"] == "server_overloaded", err.body
            assert "predicted TTFT" in err.body["message"] and "SLO 0.001" in err.body["message"], err.body
        busy.close()
        metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
        assert 'pagedllm_proxy:requests_total{outcome="rejected"} 2.0' in metrics, metrics
    finally:
        proxy.close()
    wait_metrics(decode, lambda m: m[USED] == 0, "the cut stream's blocks freed", timeout=30)


@pytest.mark.timeout(60)
def test_unreachable_prefill_instance_is_a_502(servers):
    """A prefill URL nothing listens on: the client gets an OpenAI error object naming it, at once."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = Proxy(dead, servers[1].url)
    try:
        r = httpx.post(
            proxy.url + "/v1/completions", timeout=30, json={"model": TINY, "prompt": [5, 6, 7], "max_tokens": 3}
        )
        err = assert_error(r, 502)
        assert err["type"] == "upstream_error" and dead in err["message"], err
        assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200
    finally:
        proxy.close()


@pytest.mark.timeout(180)
def test_decode_instance_killed_mid_stream(servers):
    """A decode instance killed while it streams through the proxy: the client's stream ends with
    an error event and [DONE] (no hang, no cut without a word), and the proxy serves on."""
    prefill = servers[0]
    # Every step of a request holding token 7 sleeps 20 ms there: the stream lasts ~5 s, so it
    # cannot end whole before the kill (it did once in CI: the tiny model streams 248 tokens fast).
    decode = tiny_server(
        MAX_LEN, "--kv-transfer-config", _kv_config("kv_consumer", 3.0), env={"PAGEDLLM_FAULT_INJECTION": "slow:7:20"}
    )
    proxy = Proxy(prefill.url, decode.url)
    try:
        body = {
            "model": TINY,
            "prompt": [5, 6, 7],
            "max_tokens": MAX_LEN - 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        events = []
        # No hang: a stream left open would end in the client's timeout (an exception), not [DONE].
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:  # streaming: stop the instance at once, then kill it
                    os.killpg(decode.proc.pid, signal.SIGSTOP)
                    os.killpg(decode.proc.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert "failed mid-stream" in err["message"] and decode.url in err["message"], err
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
        assert len(texts) < MAX_LEN - 8, len(texts)  # cut, not finished
        metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
        assert 'pagedllm_proxy:requests_total{outcome="decode_error"} 1.0' in metrics, metrics
        assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200
    finally:
        proxy.close()
        decode.close()
    wait_metrics(prefill, lambda m: m[USED] == 0, "no producer block leaked", timeout=30)


def _prefill_only(prefill, prompt) -> dict:
    r = httpx.post(
        prefill.url + "/v1/completions",
        timeout=60,
        json={
            "model": TINY,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


@pytest.mark.timeout(120)
def test_unfetched_blocks_are_freed_after_timeout(servers):
    prefill = servers[0]
    params = _prefill_only(prefill, _prompts()[0][:30])
    assert params["do_remote_prefill"] and params["remote_block_ids"], params
    assert prefill.metrics()[USED] >= len(params["remote_block_ids"])  # held for the consumer
    wait_metrics(prefill, lambda m: m[USED] == 0, "blocks freed after timeout_s", timeout=30)


def _kill_mid_transfer(prefill, decode, prompt: list[int], victim):
    """Prefill `prompt`, stop the producer so that the decode instance's pull waits unanswered,
    send the decode request, and once the decode instance holds blocks for the pull (its
    /metrics), kill `victim` (either server) -> the decode request's response or exception. A
    request that hung would end in the client's timeout: a TimeoutException, which the callers
    refuse."""
    params = _prefill_only(prefill, prompt)
    assert decode.metrics()[USED] == 0
    os.killpg(prefill.proc.pid, signal.SIGSTOP)
    try:

        async def run():
            task = asyncio.ensure_future(
                httpx.AsyncClient(timeout=60).post(
                    decode.url + "/v1/completions",
                    json={"model": TINY, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params},
                )
            )
            await asyncio.to_thread(wait_metrics, decode, lambda m: m[USED] > 0, "the decode instance pulls")
            assert not task.done(), task
            os.killpg(victim.proc.pid, signal.SIGKILL)
            return (await asyncio.gather(task, return_exceptions=True))[0]

        return asyncio.run(run())
    finally:
        os.killpg(prefill.proc.pid, signal.SIGCONT) if prefill.proc.poll() is None else None


@pytest.mark.timeout(180)
def test_consumer_killed_mid_transfer(servers):
    """The other side of the test below: a decode instance killed while it pulls. Its client's
    request fails (no hang), the producer's held blocks go back (at the latest after its
    timeout_s) and it goes on serving. A decode instance of its own: the shared one serves on."""
    prefill = servers[0]
    decode = tiny_server(MAX_LEN, "--kv-transfer-config", _kv_config("kv_consumer", 3.0))
    try:
        r = _kill_mid_transfer(prefill, decode, _prompts()[2], victim=decode)
        assert isinstance(r, httpx.HTTPError) and not isinstance(r, httpx.TimeoutException), r  # died with it
    finally:
        decode.close()
    wait_metrics(prefill, lambda m: m[USED] == 0, "no producer block leaked", timeout=30)
    r = httpx.post(
        prefill.url + "/v1/completions", timeout=60, json={"model": TINY, "prompt": [5, 6, 7], "max_tokens": 3}
    )
    assert r.status_code == 200, r.text


@pytest.mark.stops_server
@pytest.mark.timeout(120)
def test_producer_killed_mid_transfer(servers):
    prefill, decode, _ = servers
    r = _kill_mid_transfer(prefill, decode, _prompts()[1], victim=prefill)
    assert isinstance(r, httpx.Response), r
    assert r.status_code >= 500 and "KV transfer" in r.json()["error"]["message"], r.text
    wait_metrics(decode, lambda m: m[USED] == 0, "no decode block leaked", timeout=30)
    # The decode instance goes on serving.
    r = httpx.post(
        decode.url + "/v1/completions", timeout=60, json={"model": TINY, "prompt": [5, 6, 7], "max_tokens": 3}
    )
    assert r.status_code == 200, r.text


@pytest.mark.timeout(240)
def test_proxy_launches_instances_as_ray_actors():
    """`pagedllm proxy --launch-ray` on a Ray cluster (a local one this test starts, joined through
    RAY_ADDRESS as a multi-host cluster would be): the prefill and decode instances run as Ray
    actors with the TCP transport (no shared memory); greedy output through the proxy equals one
    colocated engine's, streamed and not; a decode instance killed mid-stream ends that stream
    with an error event; stopping the proxy leaves no actor and no process."""
    ray = pytest.importorskip("ray")
    from pagedllm.entrypoints.disagg_proxy.ray_launcher import RAY_NAMESPACE

    prompts = _prompts()[:4]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 << 20,
        log_to_driver=False,
    )
    proxy = None
    try:
        env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
        port = free_port()
        launch = {
            "prefill": 1,
            "decode": 1,
            "start_timeout_s": 120,
            "kv_connector_extra_config": {"use_shm": False, "timeout_s": 10},
        }
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "proxy",
                "--port",
                str(port),
                "--launch-ray",
                json.dumps(launch),
                "--serve-args",
                f"--model {TINY} --max-model-len {MAX_LEN} --kv-cache-memory 0.01",
            ],
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 150
        while True:
            assert proxy.poll() is None, "the proxy exited during start-up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the proxy was not ready in 150 s"
            time.sleep(0.3)
        names = [f"pagedllm-proxy-{port}-{role}-0" for role in ("prefill", "decode")]
        infos = [ray.get(ray.get_actor(n, namespace=RAY_NAMESPACE).wait_ready.remote(), timeout=30) for n in names]
        assert all(i["actor_pid"] != i["pid"] for i in infos)  # a server process inside each actor
        assert all(i["url"].startswith("http://127.0.0.1:") for i in infos), infos  # the cluster's loopback

        async def run():
            return await asyncio.gather(*[_one(url, p, stream=i % 2 == 1) for i, p in enumerate(prompts)])

        got = asyncio.run(run())
        assert got == _reference(prompts)
        assert 'pagedllm_proxy:requests_total{outcome="ok"} 4.0' in httpx.get(url + "/metrics").text
        pids = [p for i in infos for p in (i["actor_pid"], *session_pids(i["pid"]))]

        # The decode instance dies mid-stream: the client's stream ends with an error event.
        dec = infos[1]["pid"]
        for p in session_pids(dec):
            if p != dec:
                os.kill(p, signal.SIGSTOP)  # its engine core: the answer starts, no token comes

        async def cut():
            body = {"model": TINY, "prompt": prompts[0], "max_tokens": 8, "stream": True}
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    # The proxy answers 200 once the decode instance has: its stream is open.
                    assert r.status_code == 200
                    os.killpg(dec, signal.SIGKILL)
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        lines = asyncio.run(cut())
        assert lines[-1] == "data: [DONE]" and "decode instance" in json.loads(lines[-2][6:])["error"]["message"], lines
        assert httpx.get(url + "/health", timeout=10).status_code == 200

        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(60) == 0
        for n in names:
            with pytest.raises(ValueError):
                ray.get_actor(n, namespace=RAY_NAMESPACE)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], pids
    finally:
        if proxy is not None and proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait(10)
        ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "args, field",
    [
        (["--launch-ray", '{"prefill": 0}'], "prefill"),
        (["--launch-ray", '{"decode": 1, "gpus": 2}'], "gpus"),
        (["--launch-ray", '{"num_cpus": -1}'], "num_cpus"),
        (["--launch-ray", "{}", "--serve-args", "--port 9000"], "--port"),
        (["--launch-ray", "{}", "--prefill", "http://127.0.0.1:1"], "--prefill"),
        (["--prefill", "http://127.0.0.1:1"], "--decode"),
    ],
)
def test_proxy_bad_launch_args(args, field, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["proxy", *args]) == 2  # a clear error naming the field, before Ray starts
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--decode-max-num-seqs", "0"), ("--ttft-slo", "-1")])
def test_proxy_bad_flag_values(flag, value, capsys):
    from pagedllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:  # argparse's usage error, naming the flag
        main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err
