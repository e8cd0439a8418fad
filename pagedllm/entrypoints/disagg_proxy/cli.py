"""`pagedllm proxy --port N --prefill URL... --decode URL... [--ttft-slo S] [--tbt-slo S]`, or
`pagedllm proxy --launch-ray '{"prefill": N, "decode": M}' --serve-args "--model ..."` to start
the instances as Ray actors (ray_launcher.py)."""
from __future__ import annotations

import argparse
import shlex
import signal
import sys

from pagedllm.entrypoints.disagg_proxy.decode_queue import DEFAULT_MAX_NUM_SEQS


def add_proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="P/D disaggregation: route each request to a prefill instance, "
                                     "then a decode instance (both `pagedllm serve --kv-transfer-config`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", nargs="+", default=None, help="prefill instances' base URLs (kv_producer)")
    p.add_argument("--decode", nargs="+", default=None, help="decode instances' base URLs (kv_consumer)")
    p.add_argument("--launch-ray", default=None, metavar="JSON",
                   help='start the instances as Ray actors instead (RAY_ADDRESS, else a local cluster): '
                        '{"prefill": N, "decode": M, "num_cpus": 1, "start_timeout_s": 300, '
                        '"kv_connector_extra_config": {...}}')
    p.add_argument("--serve-args", default="", help="with --launch-ray: the `pagedllm serve` arguments of "
                                                     "every instance (one string, e.g. \"--model M\")")
    p.add_argument("--ttft-slo", type=_positive, default=None,
                   help="refuse (503) a request whose predicted time to first token exceeds this (seconds)")
    p.add_argument("--tbt-slo", type=_positive, default=None,
                   help="refuse (503) a request whose predicted time between tokens exceeds this (seconds)")
    p.add_argument("--decode-max-num-seqs", type=_positive_int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                   help="the decode instances' --max-num-seqs: a stream beyond waits for a slot "
                        f"(default {DEFAULT_MAX_NUM_SEQS}, the engine's)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="debug: append one JSON line per admitted streamed request (predicted and measured "
                        "TTFT and its parts) to PATH")
    p.set_defaults(func=cmd_proxy)


def _positive(value: str) -> float:
    v = float(value)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value}")
    return v


def _positive_int(value: str) -> int:
    v = int(value)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return v


def _serve_args(value: str) -> list[str]:
    args = shlex.split(value)
    for flag in ("--kv-transfer-config", "--port", "--host"):
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise ValueError(f"--serve-args must not set {flag}: the launcher sets it for each instance")
    return args


def cmd_proxy(ns: argparse.Namespace) -> int:
    import uvicorn
    from pagedllm.entrypoints.disagg_proxy.app import build_app
    from pagedllm.gc_heap import freeze_gc_heap
    instances = None
    if ns.launch_ray is not None:
        if ns.prefill or ns.decode:
            raise ValueError("--launch-ray starts the instances: give it without --prefill / --decode")
        from pagedllm.entrypoints.disagg_proxy.ray_launcher import LaunchSpec, RayInstances
        spec, serve_args = LaunchSpec.from_cli(ns.launch_ray), _serve_args(ns.serve_args)
        instances = RayInstances(spec, serve_args, name_prefix=f"pagedllm-proxy-{ns.port}")
        ns.prefill, ns.decode = instances.prefill_urls, instances.decode_urls
        # uvicorn re-raises SIGTERM once it has stopped; Ray's driver handler would exit 15: end
        # with 0 instead, through the `finally` that stops the instances.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    elif not ns.prefill or not ns.decode:
        raise ValueError("give --prefill URL... and --decode URL... (or --launch-ray)")
    try:
        for url in ns.prefill + ns.decode:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--prefill / --decode take http(s) URLs, got {url!r}")
        app = build_app(ns.prefill, ns.decode, ns.ttft_slo, ns.tbt_slo, trace=ns.trace,
                        decode_max_num_seqs=ns.decode_max_num_seqs)
        freeze_gc_heap("proxy")
        uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    finally:
        if instances is not None:
            instances.shutdown()
    return 0
