"""The workload fuzzer on the real server.

A real `pagedllm serve` of `random:tiny` on 127.0.0.1 with few sequences and a tiny KV cache;
concurrent clients (the official `openai` client) send a fixed number of the engine fuzzer's
random requests (tests/fuzz_workload.py; the same requests on any machine, however fast;
`--fuzz-seconds S` sends them for S seconds instead): completions and chat, streamed and not,
n / best_of / beam search (`use_beam_search`), stop strings, min_tokens, logprobs, prompts up
to max_model_len, and client disconnects mid-request or mid-stream. Afterwards: no 5xx other
than overload 503s, every 200 well formed, greedy and seeded requests' texts equal to the same
request run alone offline, no KV block in use (`/metrics`), `/health` 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest

from fuzz_workload import MODEL, EngineSpec, RequestSpec, draw_requests
from server_utils import RemoteServer, wait_idle
from engine.test_engine_fuzz import TIE_EPS, Reference, one_thread, reference  # noqa: F401 (fixtures)

NAME = "fuzz"
CI_REQUESTS = 1000  # about 20-30 s on a 2-core machine
CONCURRENCY = 8
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # "w5 w17" -> [5, 17]
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions' max_tokens when none is sent
TICK_S = 0.02  # a disconnect after k ticks (non-streamed) or k chunks (streamed)


def server_spec(seed: int) -> EngineSpec:
    """Room for a few full-length sequences only: preemption and overload are the normal case."""
    rng = random.Random(f"server-{seed}")
    mode = rng.choice(["recompute", "swap"])
    return EngineSpec(
        block_size=4,
        max_model_len=48,
        max_num_seqs=4,
        num_gpu_blocks=2 * 12 + 1,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        enable_chunked_prefill=True,
        enable_prefix_caching=rng.random() < 0.7,
        preemption_mode=mode,
        num_cpu_blocks=None,
        scheduling_policy=rng.choice(["fcfs", "priority"]),
    )


def kv_bytes_per_block(block_size: int) -> int:
    from pagedllm.models.random_model import random_model_dir

    cfg = json.loads((Path(random_model_dir(MODEL)) / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4  # float32


def workload(seed: int):
    """An endless stream of the fuzzer's requests, case after case."""
    spec = server_spec(seed)
    for case in range(10**9):
        yield from draw_requests(random.Random(f"server-{seed}-{case}"), spec, prefix=f"s{case}")


# ------------------------------------------------------------------ one request through openai
def openai_kwargs(req: RequestSpec) -> dict:
    kw: dict = {"model": NAME, "stream": req.stream}
    extra: dict = {}
    if req.max_tokens is not None:
        kw["max_tokens"] = req.max_tokens
    if req.is_beam:
        kw["n"] = req.beam_width
        extra.update(use_beam_search=True, length_penalty=req.length_penalty)
    else:
        p = req.params
        for name in ("temperature", "seed", "n", "stop"):
            if name in p:
                kw[name] = p[name]
        if p.get("min_tokens"):
            extra["min_tokens"] = p["min_tokens"]
        if "logprobs" in p:
            kw.update(logprobs=True, top_logprobs=p["logprobs"]) if req.chat else kw.update(logprobs=p["logprobs"])
        if "best_of" in p:
            kw["best_of"] = p["best_of"]
    if req.priority:
        extra["priority"] = req.priority
    if req.chat:
        kw["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in req.prompt)}]
    else:
        kw["prompt"] = req.prompt
    if extra:
        kw["extra_body"] = extra
    return kw


def check_choices(req: RequestSpec, finish: dict[int, str]) -> None:
    """The finish_reason of every choice a 200 returned, by index."""
    n = req.beam_width or req.params.get("n", 1)
    assert sorted(finish) == list(range(n)), (req.describe(), finish)
    assert all(f in ("stop", "length") for f in finish.values()), (req.describe(), finish)


def _text(choice, chat: bool, stream: bool) -> str:
    if not chat:
        return choice.text or ""
    return (choice.delta.content if stream else choice.message.content) or ""


async def send(client: openai.AsyncOpenAI, req: RequestSpec) -> tuple[str, dict[int, str]]:
    """-> (the outcome: an HTTP status as text, 'disconnected', or a failure description;
    the text of each choice of a 200)."""
    kw = openai_kwargs(req)
    create = client.chat.completions.create if req.chat else client.completions.create
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    try:
        if not req.stream:
            call = create(**kw)
            if req.abort_after is not None:
                try:
                    r = await asyncio.wait_for(call, req.abort_after * TICK_S)
                except asyncio.TimeoutError:
                    return "disconnected", {}
            else:
                r = await call
            for c in r.choices:
                texts[c.index], finish[c.index] = _text(c, req.chat, False), c.finish_reason
        else:
            stream = await create(**kw)
            chunks = 0
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + _text(c, req.chat, True)
                    if c.finish_reason is not None:
                        finish[c.index] = c.finish_reason
                chunks += 1
                if req.abort_after is not None and chunks > req.abort_after:
                    await stream.close()
                    return "disconnected", {}
        check_choices(req, finish)
        return "200", texts
    except openai.APIStatusError as e:
        code = e.code or (e.body.get("code") if isinstance(e.body, dict) else None)
        return (f"{e.status_code} {code}" if e.status_code >= 500 else str(e.status_code)), {}
    except openai.APIError as e:  # an error event inside a stream, or the connection broke
        return f"broken: {type(e).__name__}: {e}", {}


def has_tie(comp) -> bool:
    """Whether the reference met a numerical tie (its top-2 within TIE_EPS) anywhere."""
    for lps in comp.logprobs or []:
        top = sorted((lp.logprob for lp in lps.values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < TIE_EPS:
            return True
    return False


def compare_alone(served: list, reference: Reference, max_model_len: int) -> list[str]:
    """Greedy and seeded requests' texts against the same request run alone offline."""
    bad = []
    for req, texts in served:
        if req.max_tokens is None and not req.chat:  # what the server takes (OpenAI's default)
            req = dataclasses.replace(req, max_tokens=COMPLETIONS_MAX_TOKENS)
        ref = reference.run(req, max_model_len)
        for i, text in texts.items():
            if text != ref[i].text and not (req.greedy and has_tie(ref[i])):
                bad.append(f"choice {i} is {text!r}, alone {ref[i].text!r} <- {req.describe()}")
    return bad


async def run_clients(server: RemoteServer, seed: int, seconds: Optional[float]) -> tuple[Counter, list[str], list]:
    """CI_REQUESTS requests (or as many as `seconds` allow) -> outcomes by kind, the failures,
    and (request, texts) of the reproducible 200s."""
    client = server.async_client(timeout=60)
    requests = workload(seed)
    outcomes: Counter = Counter()
    bad: list[str] = []
    served: list = []
    deadline = time.monotonic() + seconds if seconds else None
    drawn = 0

    def more() -> bool:
        return time.monotonic() < deadline if deadline is not None else drawn < CI_REQUESTS

    async def worker():
        nonlocal drawn
        while more():
            drawn += 1
            req = next(requests)
            try:
                outcome, texts = await send(client, req)
            except AssertionError as e:
                outcome, texts = f"malformed 200: {e}", {}
            outcomes[outcome.split(":")[0]] += 1
            if outcome not in ("200", "400", "disconnected", "503 server_overloaded"):
                bad.append(f"{outcome} <- {req.describe()}")
            elif outcome == "200" and req.reproducible:
                served.append((req, texts))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    await client.close()
    return outcomes, bad, served


@pytest.fixture(scope="module")
def fuzz_server(request):
    seed = request.config.getoption("--fuzz-seed")
    spec = server_spec(seed)
    kv_gib = spec.num_gpu_blocks * kv_bytes_per_block(spec.block_size) / 2**30
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # see one_thread: a second thread only spins
        srv = RemoteServer(
            [
                "--model",
                MODEL,
                "--served-model-name",
                NAME,
                "--chat-template",
                CHAT_TEMPLATE,
                "--kv-cache-memory",
                repr(kv_gib),
                "--swap-space",
                "0.0001",
                "--max-waiting-requests",
                "12",
                *spec.server_args(),
            ]
        )
    yield srv, seed, spec
    srv.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_server_fuzz(request, fuzz_server, reference):
    server, seed, spec = fuzz_server
    seconds = request.config.getoption("--fuzz-seconds")
    t0 = time.monotonic()
    outcomes, bad, served = asyncio.run(run_clients(server, seed, seconds))
    bad += compare_alone(served, reference, spec.max_model_len)
    print(
        f"\nserver fuzz, seed {seed}, {spec}: {sum(outcomes.values())} requests in "
        f"{time.monotonic() - t0:.1f} s: {dict(outcomes)}"
    )
    log = "\n".join(line for line in server.log_text().splitlines() if "Running:" not in line)
    assert not bad, (
        f"seed {seed} (rerun: PYTHONPATH=$PWD python -m pytest -q -s tests/entrypoints/test_server_fuzz.py "
        f"--fuzz-seed {seed}): {len(bad)} requests failed ({dict(outcomes)}); the first:\n"
        + "\n".join(bad[:12])
        + f"\nserver log (tail, stats lines left out):\n{log[-4000:]}"
    )
    assert seconds or sum(outcomes.values()) == CI_REQUESTS, outcomes
    assert outcomes["200"] >= 10, outcomes
    assert server.proc.poll() is None, f"the server exited ({server.proc.returncode}):\n{log[-4000:]}"
    m = wait_idle(server, timeout=60)  # every block back once nothing runs
    assert m["pagedllm:kv_cache_usage_perc"] == 0, m
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = server.client().completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert len(r.choices[0].text.split()) == 4 or r.choices[0].finish_reason == "stop"
