"""The proxy's OpenAI routes: each request is prefilled (max_tokens 1, kv_transfer_params
{"do_remote_decode": true}) on the prefill instance of the lowest predicted TTFT, then sent with
the prefill's kv_transfer_params to a decode instance, whose answer (streamed or not) is the
client's. Refused at once with 503 when the predicted TTFT or TBT misses the SLO (the TTFT against
`SloFeedback`'s target: the SLO lowered while the admitted requests' measured p99 passes it).
`trace`: one JSON line per admitted streamed request, the prediction by part beside what was
measured (debugging the predictor: where the admitted TTFT goes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Optional

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.entrypoints.disagg_proxy.decode_queue import DEFAULT_MAX_NUM_SEQS
from pagedllm.entrypoints.disagg_proxy.fit import TailMargin
from pagedllm.entrypoints.disagg_proxy.predictor import (
    Admission,
    DecodeInstance,
    PrefillInstance,
    chunk_hashes,
    now,
    plan,
)
from pagedllm.entrypoints.disagg_proxy.slo_feedback import SloFeedback

logger = logging.getLogger(__name__)

# What a failed upstream call raises (refused, reset, cut mid-stream, timed out).
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def _error_body(message: str, type_: str, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _error(status: int, message: str, type_: str, code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=_error_body(message, type_, code))


def _trace_record(
    a: Admission,
    position: int,
    t0: float,
    t_planned: float,
    t_prefilled: float,
    t_sent: float,
    t_first: float,
    target: Optional[float],
) -> dict:
    """Predicted beside measured, in seconds: the prefill's queue and work against its answer, the
    decode side's transfer + slot wait + steps against its first token; `front`: from the request's
    arrival in the app to its admission (the body read, the route, the plan)."""
    return {
        "t0": round(t0, 4),
        "position": position,
        "pending": a.decode.pending,
        "pred_queue": a.queue,
        "pred_prefill": a.seconds,
        "pred_transfer": a.first.transfer,
        "pred_slot_wait": a.first.slot_wait,
        "pred_step": a.first.step,
        "pred_ttft": a.ttft,
        "margin": a.margin,
        "load_margin": a.load_margin,
        "load": a.load,
        "target": target,
        "limit": a.decode.limit.limit,
        "front": t_planned - t0,
        "prefill": t_prefilled - t0,
        "decode_first": t_first - t_sent,
        "ttft": t_first - t0,
    }


ARRIVAL = "pagedllm.arrival"  # the ASGI scope's key for _Arrival's stamp


class _Arrival:
    """Stamps each HTTP request with the time the app began to handle it (`scope[ARRIVAL]`): the
    TTFT the proxy measures and holds the SLO to starts there, not once the body is read and the
    route found, which a busy event loop delays as the client counts them."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[ARRIVAL] = now()
        await self.app(scope, receive, send)


def _json_object(content: bytes) -> Optional[dict]:
    try:
        obj = json.loads(content)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pagedllm_proxy:requests", "Requests by outcome.", ["outcome"], registry=r)
        self.predicted_ttft = Histogram(
            "pagedllm_proxy:predicted_ttft_seconds",
            "Predicted TTFT of admitted requests.",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )
        self.ttft = Histogram(
            "pagedllm_proxy:ttft_seconds",
            "Observed TTFT (streamed requests).",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )
        self.kv_blocks = Counter(
            "pagedllm_proxy:kv_blocks_moved", "KV blocks handed from prefill to decode.", registry=r
        )
        self.queue = Gauge(
            "pagedllm_proxy:prefill_queue_seconds", "Booked prefill work ahead.", ["instance"], registry=r
        )
        self.streams = Gauge("pagedllm_proxy:decode_streams", "Requests decoding.", ["instance"], registry=r)
        self.load_limit = Gauge(
            "pagedllm_proxy:decode_load_limit",
            "The most streams + pending a decode instance is admitted (with --ttft-slo; load_limit.py).",
            ["instance"],
            registry=r,
        )
        self.pending = Gauge(
            "pagedllm_proxy:decode_pending",
            "Requests admitted to a decode instance, still prefilling.",
            ["instance"],
            registry=r,
        )
        self.margin = Gauge(
            "pagedllm_proxy:ttft_margin_seconds",
            "What recent TTFT predictions missed by at the lowest load (the tail added before the SLO check).",
            registry=r,
        )
        self.target = Gauge(
            "pagedllm_proxy:ttft_target_seconds",
            "The TTFT the admission holds predictions "
            "to: the SLO lowered while the admitted requests' measured p99 passes it.",
            registry=r,
        )


def build_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    ttft_slo: Optional[float] = None,
    tbt_slo: Optional[float] = None,
    timeout: float = 600.0,
    trace: Optional[str] = None,
    decode_max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> FastAPI:
    session: Optional[aiohttp.ClientSession] = None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if session is not None:
            await session.close()

    def client() -> aiohttp.ClientSession:
        """One session for the proxy's life, made in the server's loop. aiohttp rather than httpx:
        a client reading a stream spends about a fifth of httpx's CPU on it (3.3 against 15.8 ms
        for 33 events, BENCHMARKS.md), and the proxy shares the cores it routes to.
        Idle connections expire before the instances' (uvicorn: 5 s), so that a request never goes
        out on a connection the instance is closing (a retry could not be safe: the KV is fetched
        once). No total timeout: a stream lasts as long as its generation; `timeout` bounds each read."""
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0),
            )
        return session

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(_Arrival)
    prefills = [PrefillInstance(u.rstrip("/")) for u in prefill_urls]
    decodes = [DecodeInstance(u.rstrip("/"), decode_max_num_seqs) for u in decode_urls]
    margin = TailMargin()
    feedback = SloFeedback(ttft_slo) if ttft_slo is not None else None
    metrics = _Metrics()
    trace_f = open(trace, "a", buffering=1) if trace else None

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        t = now()
        for p in prefills:
            metrics.queue.labels(p.url).set(max(p.busy_until - t, 0.0))
        for d in decodes:
            metrics.streams.labels(d.url).set(d.streams)
            metrics.pending.labels(d.url).set(d.pending)
            metrics.load_limit.labels(d.url).set(d.limit.limit)
        metrics.margin.set(margin.at(t)[0])
        if feedback is not None:
            metrics.target.set(feedback.target)
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        async with client().get(decodes[0].url + "/v1/models") as r:
            return Response(await r.read(), status_code=r.status, media_type="application/json")

    async def handle(path: str, raw: Request):
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        text = json.dumps(body.get("messages")) if "messages" in body else str(body.get("prompt", ""))
        hashes, t0 = chunk_hashes(text), raw.scope.get(ARRIVAL) or now()
        a = plan(prefills, decodes, hashes, len(text), t0, margin)
        t_planned = now()
        prefill, decode, seconds = a.prefill, a.decode, a.seconds
        target = feedback.target if feedback is not None else None
        if a.misses(target, tbt_slo, limited=bool(body.get("stream"))):
            metrics.requests.labels("rejected").inc()
            return _error(
                503,
                f"overloaded: predicted TTFT {a.ttft:.3f} s + margin {a.margin:.3f} + "
                f"{a.load_margin:.3f} s at load {a.load} (limit {decode.limit.limit:.0f}; SLO "
                f"{ttft_slo}, held to {target or 0:.3f} s), TBT {a.tbt:.4f} s (SLO {tbt_slo})",
                "service_unavailable",
                "server_overloaded",
            )
        metrics.predicted_ttft.observe(a.ttft)
        prefill.book(seconds, t0)
        decode.admit()
        pre_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        pre_body.pop("stream_options", None)
        if "max_completion_tokens" in pre_body:
            pre_body["max_completion_tokens"] = 1
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        booked, kvp, finish = True, None, None
        try:
            async with client().post(prefill.url + path, json=pre_body, headers=headers) as r:
                status, ctype, content = r.status, r.headers.get("content-type", ""), await r.read()
            finish = now()
            pre = _json_object(content) if ctype.startswith("application/json") else None
            if status != 200 or pre is None:
                metrics.requests.labels("prefill_error").inc()
                return Response(content, status_code=status, media_type=ctype or None)
            usage = pre.get("usage") or {}
            prompt_tokens = usage.get("prompt_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            prefill.done(hashes, seconds, t0, finish, prompt_tokens - cached, prompt_tokens, len(text))
            booked = False
            kvp = pre.get("kv_transfer_params")
            if not kvp:
                metrics.requests.labels("prefill_error").inc()
                return _error(
                    502,
                    f"the prefill instance {prefill.url} returned no kv_transfer_params "
                    "(is it started with --kv-transfer-config kv_producer?)",
                    "upstream_error",
                )
            metrics.kv_blocks.inc(len(kvp.get("remote_block_ids", ())))
        except _UPSTREAM_ERRORS as e:
            metrics.requests.labels("prefill_error").inc()
            return _error(502, f"the prefill instance {prefill.url} failed: {type(e).__name__}: {e}", "upstream_error")
        finally:
            if booked:
                prefill.done([], seconds, t0, None)
            if not kvp:  # no decode request will go out
                decode.cancel()
        return await _decode(path, dict(body, kv_transfer_params=kvp), a, headers, t0, t_planned, finish)

    async def _decode(path, body, a: Admission, headers, t0, t_planned, t_prefilled):
        decode = a.decode
        position, t1 = decode.start(), now()
        if not body.get("stream"):
            try:
                async with client().post(decode.url + path, json=body, headers=headers) as r:
                    status, ctype, content = r.status, r.headers.get("content-type"), await r.read()
            except _UPSTREAM_ERRORS as e:
                metrics.requests.labels("decode_error").inc()
                return _error(
                    502, f"the decode instance {decode.url} failed: {type(e).__name__}: {e}", "upstream_error"
                )
            finally:
                decode.end()
            metrics.requests.labels("ok" if status == 200 else "decode_error").inc()
            return Response(content, status_code=status, media_type=ctype)
        try:
            r = await client().post(decode.url + path, json=body, headers=headers)
        except _UPSTREAM_ERRORS as e:
            decode.end()
            metrics.requests.labels("decode_error").inc()
            return _error(502, f"the decode instance {decode.url} failed: {type(e).__name__}: {e}", "upstream_error")
        if r.status != 200:
            try:
                content = await r.read()
            except _UPSTREAM_ERRORS:
                content = b""
            r.release()
            decode.end()
            metrics.requests.labels("decode_error").inc()
            return Response(content, status_code=r.status, media_type=r.headers.get("content-type"))

        async def relay():
            first = last = None
            try:
                async for chunk in r.content.iter_any():
                    t = now()
                    if first is None:
                        first = t
                        decode.first_token(t, position, t - t1)
                        margin.add(t, t - t0, a.ttft, a.load)
                        if feedback is not None:
                            decode.limit.add(t, t0, a.load, t - t0, feedback.target)
                            feedback.add(t, t0, t - t0)
                        metrics.ttft.observe(t - t0)
                        if trace_f is not None:
                            trace_f.write(
                                json.dumps(
                                    _trace_record(
                                        a, position, t0, t_planned, t_prefilled, t1, t, feedback and feedback.target
                                    )
                                )
                                + "\n"
                            )
                    else:
                        decode.gap(t, t - last)
                    last = t
                    yield chunk
                metrics.requests.labels("ok").inc()
            except _UPSTREAM_ERRORS as e:
                # The decode instance died mid-stream: say so in the stream (as the server does
                # for an error after the stream began) rather than just cutting it.
                metrics.requests.labels("decode_error").inc()
                yield (
                    "data: "
                    + json.dumps(
                        _error_body(
                            f"the decode instance {decode.url} failed mid-stream: {type(e).__name__}: {e}",
                            "upstream_error",
                        )
                    )
                    + "\n\ndata: [DONE]\n\n"
                ).encode()
            finally:
                decode.end(None if first is None else last - first)
                r.release()  # back to the pool once read to the end; closed (aborting the decode) if cut

        return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await handle("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await handle("/v1/chat/completions", raw)

    app.state.prefills, app.state.decodes = prefills, decodes
    return app
