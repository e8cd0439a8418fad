"""The `pagedllm` command: download, generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.cli_fields import add_dataclass_args, dataclass_from_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, generated from EngineArgs' fields (engine/cli_fields.py)."""
    add_dataclass_args(p, EngineArgs)
    p.add_argument(
        "--task",
        default=None,
        choices=["generate", "embed"],
        help="the older name of --runner: embed is --runner pooling",
    )


def _runner(ns: argparse.Namespace) -> str:
    """--runner, or its alias --task (embed = pooling); ValueError when they disagree."""
    from_task = {"embed": "pooling", "generate": "generate", None: None}[getattr(ns, "task", None)]
    runner = getattr(ns, "runner", None)
    if runner is not None and from_task is not None and runner != from_task:
        raise ValueError(f"--runner {runner} and --task {ns.task} disagree; give one of them")
    return runner or from_task or "generate"


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return dataclass_from_args(EngineArgs, ns, runner=_runner(ns))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)


def sampling_params_from(ns: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
    )


def cmd_download(ns) -> int:
    from pagedllm.models.download import ensure_ready_model

    print(ensure_ready_model(ns.name, progress=True))
    return 0


def _make_llm(ns):
    from pagedllm.entrypoints.llm import LLM

    args = engine_args_from(ns)
    return LLM(**vars(args))


def cmd_generate(ns) -> int:
    params = sampling_params_from(ns)
    llm = _make_llm(ns)
    prompts = ns.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(messages, params) if ns.chat_template else llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        print(f"### {p!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]\n")
    return 0


def cmd_chat(ns) -> int:
    params = sampling_params_from(ns)
    llm = _make_llm(ns)
    history = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("pagedllm chat: type a message, an empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(ns) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    return run_server(dataclass_from_args(FrontendArgs, ns), engine_args_from(ns))


def cmd_run_batch(ns) -> int:
    import asyncio

    from pagedllm.entrypoints.run_batch import run_batch

    return asyncio.run(run_batch(ns, engine_args_from(ns)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference with a paged KV cache")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("download", help="prepare a ready model (default SmolLM2-135M-Instruct) in $PAGEDLLM_HOME")
    p.add_argument(
        "name",
        nargs="?",
        default="SmolLM2-135M-Instruct",
        choices=["SmolLM2-135M-Instruct", "gemma3-270m"],
        help="which ready model",
    )
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("generate", help="generate from prompts (arguments, or one per line on stdin)")
    p.add_argument("prompts", nargs="*")
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="an interactive chat with the model")
    p.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (engine core in its own process)")
    from pagedllm.entrypoints.openai.cli_args import RUN_BATCH_FIELDS, FrontendArgs, add_serve_args

    add_serve_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run-batch", help="run a file of requests in OpenAI's batch format (JSONL) offline")
    p.add_argument("-i", "--input-file", required=True, help="JSONL: {custom_id, method, url, body} per line")
    p.add_argument("-o", "--output-file", required=True, help="JSONL: {id, custom_id, response, error} per line")
    p.add_argument("--disable-progress-bar", action="store_true")
    add_dataclass_args(p, FrontendArgs, only=RUN_BATCH_FIELDS)
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)

    from pagedllm.entrypoints.disagg_proxy.cli import add_proxy_parser

    add_proxy_parser(sub)

    from pagedllm.benchmarks.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)

    from pagedllm.models.gguf.cli import add_make_gguf_parser

    add_make_gguf_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
