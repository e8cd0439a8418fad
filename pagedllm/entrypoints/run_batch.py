"""`pagedllm run-batch -i in.jsonl -o out.jsonl`: a file of requests in OpenAI's batch format, run
through the server's own app in this process (no port), all lines at once so that the engine
batches them.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url /v1/completions,
/v1/chat/completions, /v1/embeddings, /v1/score (/score) or /v1/rerank (/rerank, /v2/rerank);
an encoder model (BERT and kin) runs as `pagedllm serve` runs it; each output line, in the input's order, is OpenAI's
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}` (an API
error, e.g. a 400, is the body of its response, as OpenAI's). A line that is not such a request
gets `{"id", "custom_id", "response": null, "error": {"code", "message"}}` and the rest still run.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Optional

from tqdm import tqdm

URLS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
)
MAX_IN_FLIGHT = 256  # requests sent to the app at a time (below its --max-waiting-requests)


class BadLine(ValueError):
    def __init__(self, custom_id: Optional[str], message: str) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(line: str) -> tuple[str, str, dict]:
    """-> (custom_id, url, body); BadLine naming the field and what is allowed."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise BadLine(None, f"the line is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadLine(None, f"the line must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(None, f"custom_id must be a non-empty string, got {custom_id!r}")
    if obj.get("method") != "POST":
        raise BadLine(custom_id, f"method must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        raise BadLine(custom_id, f"url must be one of {', '.join(URLS)}; got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine(custom_id, f"body must be a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        raise BadLine(custom_id, "body.stream must be false or absent: a batch has no streams")
    return custom_id, url, body


def error_record(custom_id: Optional[str], message: str) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": message},
    }


async def post(app, path: str, body: dict) -> tuple[int, dict]:
    """POST `body` as JSON to the ASGI `app` -> (status, the JSON answer): the server's routing,
    validation and error handling, without a socket."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("batch", 80),
    }
    sent = False
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # the client never goes away
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, json.loads(b"".join(chunks))


async def run_lines(app, lines: list[str], show_progress: bool = True) -> list[dict]:
    """Every line's output record, in order."""
    records: list[Optional[dict]] = [None] * len(lines)
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    bar = tqdm(total=len(lines), desc="Running batch", disable=not show_progress, dynamic_ncols=True)

    async def one(i: int, line: str) -> None:
        try:
            custom_id, url, body = parse_line(line)
        except BadLine as e:
            records[i] = error_record(e.custom_id, str(e))
        else:
            async with gate:
                status, answer = await post(app, url, body)
            records[i] = {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": custom_id,
                "response": {
                    "status_code": status,
                    "request_id": answer.get("id") or f"req_{uuid.uuid4().hex}",
                    "body": answer,
                },
                "error": None,
            }
        bar.update(1)

    await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
    bar.close()
    return records


async def run_batch(ns, engine_args) -> int:
    from pagedllm.engine.async_encoder import make_async_engine
    from pagedllm.entrypoints.openai.api_server import _load_chat_template, build_app
    from pagedllm.models.download import DEFAULT_MODEL, DEFAULT_MODEL_ALIASES

    with open(ns.input_file) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    model = engine_args.model
    names = ns.served_model_name or [DEFAULT_MODEL if model is None or model in DEFAULT_MODEL_ALIASES else model]
    engine = make_async_engine(engine_args, names[0], log_level="WARNING")
    try:
        await engine.start()
        app = build_app(
            engine,
            names,
            chat_template=_load_chat_template(ns.chat_template),
            enable_auto_tool_choice=ns.enable_auto_tool_choice,
            tool_call_parser=ns.tool_call_parser,
            reasoning_parser=ns.reasoning_parser,
        )
        records = await run_lines(app, lines, show_progress=not ns.disable_progress_bar)
    finally:
        await engine.shutdown()
    with open(ns.output_file, "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return 0
