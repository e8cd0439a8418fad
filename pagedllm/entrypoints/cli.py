"""The `pagedllm` command: download, generate, chat, serve, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedllm.attention.backends.registry import backend_choices
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.layers.quantization.registry import quantization_choices


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    p.add_argument("--model", default=None, help="HF-format model directory (default: SmolLM2-135M-Instruct, built on first use)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="context length (default: the model's)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests in one step (default 128)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (default 2048)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for the KV cache (default 4)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default auto: float32 on cpu, the config's on cuda)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU swap space (default 4)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer over N processes (torch.distributed; default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into N pipeline stages, one process each (default 1)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="N engine replicas behind a prefix-cache-aware router (serve; default 1)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                   help="where the model runs (default auto: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", *backend_choices()],
                   help="paged attention kernels (default auto: triton on cuda, torch + C++ on cpu)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of the GPU's memory for weights, activations and KV cache (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run every step eagerly instead of replaying CUDA graphs")
    p.add_argument("--cudagraph-mode", default=d.cudagraph_mode, type=str.upper,
                   choices=["NONE", "FULL_DECODE_ONLY", "FULL"],
                   help="GPU: CUDA graphs of decode steps only, or of mixed prefill + decode steps too at "
                        "padded token counts (FULL, default); NONE as --enforce-eager (vLLM's names)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule and submit step N+1 while step N runs on the device, so that the host's "
                        "work overlaps it (vLLM's flag; not with speculative decoding, beam search, "
                        "structured outputs, pooling, P/D or tensor / pipeline parallelism)")
    p.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                   help="fcfs (arrival order, default) or priority: each request's priority (lower first, "
                        "then arrival) orders the queue and picks who is preempted (vLLM's flag)")
    p.add_argument("--generation-config", default=d.generation_config,
                   help="sampling defaults: auto (the model's generation_config.json: temperature, top_p, "
                        "top_k, min_p, repetition_penalty, unless a request sets them), vllm (none), or "
                        "a folder holding a generation_config.json (vLLM's flag)")
    p.add_argument("--runner", default=None, choices=["generate", "pooling"],
                   help="generate (sampling, default) or pooling: an embedding per prompt, served on "
                        "/v1/embeddings (vLLM's flag)")
    p.add_argument("--task", default=None, choices=["generate", "embed"],
                   help="the older name of --runner: embed is --runner pooling")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag)")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="most distinct adapters in one step: the device slots (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory, LRU (default: --max-loras)")
    p.add_argument("--quantization", "-q", default=None, choices=quantization_choices(),
                   help="CPU weight-only quantization: int8, int4 (groups), gguf (the "
                        "default model's shipped Q4_1 file, or --model FILE.gguf, served as it is)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="int4 / int8: input features per scale (and min: int4), 32 (default), 64 or 128; "
                        "int8 -1: one scale per output channel")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache element: auto (the model's dtype), or int8 / fp8 with a float32 scale "
                        "per token and KV head (fp8 = fp8_e4m3; vLLM's flag)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="where the ranks run: local processes (mp, default) or a Ray cluster "
                        "(RAY_ADDRESS, else a local one)")
    p.add_argument("--kv-transfer-config", default=None,
                   help='P/D disaggregation (vLLM\'s flag), JSON: {"kv_connector": "ZmqConnector", "kv_role": '
                        '"kv_producer" | "kv_consumer" | "kv_both", "kv_ip", "kv_port", '
                        '"kv_connector_extra_config": {"timeout_s", "use_shm"}}')
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON (vLLM\'s): {"method": "ngram" | "draft_model" | "mtp", '
                        '"num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 8, '
                        '"model": "self:N" | DIR, "length_policy": "fixed" | "adaptive"}')


def _speculative_config(text: str) -> dict:
    """--speculative-config: checked at parse time, so a bad one is an argparse error naming the field."""
    from pagedllm.config import SpeculativeConfig
    try:
        SpeculativeConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def _runner(ns: argparse.Namespace) -> str:
    """--runner, or its alias --task (embed = pooling); ValueError when they disagree."""
    from_task = {"embed": "pooling", "generate": "generate", None: None}[getattr(ns, "task", None)]
    runner = getattr(ns, "runner", None)
    if runner is not None and from_task is not None and runner != from_task:
        raise ValueError(f"--runner {runner} and --task {ns.task} disagree; give one of them")
    return runner or from_task or "generate"


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kv = None if ns.kv_cache_memory is None else int(ns.kv_cache_memory * 2**30)
    return EngineArgs(model=ns.model, max_model_len=ns.max_model_len, block_size=ns.block_size,
                      max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                      kv_cache_memory=kv, dtype=ns.dtype, seed=ns.seed,
                      enable_chunked_prefill=ns.enable_chunked_prefill,
                      enable_prefix_caching=ns.enable_prefix_caching,
                      preemption_mode=ns.preemption_mode, swap_space=ns.swap_space,
                      tensor_parallel_size=ns.tensor_parallel_size,
                      pipeline_parallel_size=ns.pipeline_parallel_size,
                      data_parallel_size=ns.data_parallel_size,
                      distributed_executor_backend=ns.distributed_executor_backend,
                      device=ns.device, attention_backend=ns.attention_backend,
                      gpu_memory_utilization=ns.gpu_memory_utilization,
                      enforce_eager=ns.enforce_eager, cudagraph_mode=getattr(ns, "cudagraph_mode", "FULL"),
                      runner=_runner(ns), enable_lora=ns.enable_lora,
                      max_loras=ns.max_loras, max_lora_rank=ns.max_lora_rank, max_cpu_loras=ns.max_cpu_loras,
                      kv_transfer_config=getattr(ns, "kv_transfer_config", None),
                      quantization=ns.quantization, quantization_group_size=ns.quantization_group_size,
                      speculative_config=getattr(ns, "speculative_config", None),
                      kv_cache_dtype=getattr(ns, "kv_cache_dtype", "auto"),
                      async_scheduling=getattr(ns, "async_scheduling", False),
                      scheduling_policy=getattr(ns, "scheduling_policy", "fcfs"),
                      generation_config=getattr(ns, "generation_config", "auto"))


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
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          seed=ns.sampling_seed, stop=ns.stop)


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
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {ns.max_waiting_requests}")
    return run_server(ns, engine_args_from(ns))


def cmd_run_batch(ns) -> int:
    import asyncio

    from pagedllm.entrypoints.run_batch import run_batch
    return asyncio.run(run_batch(ns, engine_args_from(ns)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference with a paged KV cache")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("download", help="prepare a ready model (default SmolLM2-135M-Instruct) in $PAGEDLLM_HOME")
    p.add_argument("name", nargs="?", default="SmolLM2-135M-Instruct",
                   choices=["SmolLM2-135M-Instruct", "gemma3-270m"], help="which ready model")
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
    from pagedllm.entrypoints.openai.cli_args import add_serve_args
    add_serve_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run-batch", help="run a file of requests in OpenAI's batch format (JSONL) offline")
    p.add_argument("-i", "--input-file", required=True, help="JSONL: {custom_id, method, url, body} per line")
    p.add_argument("-o", "--output-file", required=True, help="JSONL: {id, custom_id, response, error} per line")
    p.add_argument("--served-model-name", nargs="+", default=None, help="the name(s) a body's `model` may give")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"])
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"])
    p.add_argument("--disable-progress-bar", action="store_true")
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
