"""`pagedllm proxy --port N --prefill URL... --decode URL... [--ttft-slo S] [--tbt-slo S]`, or
`pagedllm proxy --launch-ray '{"prefill": N, "decode": M}' --serve-args "--model ..."` to start
the instances as Ray actors (ray_launcher.py)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from pagedllm.engine.cli_fields import add_dataclass_args, arg, dataclass_from_args, positive_int
from pagedllm.entrypoints.disagg_proxy.decode_queue import DEFAULT_MAX_NUM_SEQS


def _positive(value: str) -> float:
    v = float(value)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value}")
    return v


@dataclass
class ProxyArgs:
    """The proxy's knobs; its flags are generated from these fields (engine/cli_fields.py)."""

    host: str = arg("127.0.0.1", "address to listen on")
    port: int = arg(8000, "port to listen on")
    prefill: Optional[list] = arg(None, "prefill instances' base URLs (kv_producer)", nargs="+")
    decode: Optional[list] = arg(None, "decode instances' base URLs (kv_consumer)", nargs="+")
    launch_ray: Optional[str] = arg(
        None,
        'start the instances as Ray actors instead (RAY_ADDRESS, else a local cluster): '
        '{"prefill": N, "decode": M, "num_cpus": 1, "start_timeout_s": 300, "kv_connector_extra_config": {...}}',
        metavar="JSON",
    )
    serve_args: str = arg(
        "", "with --launch-ray: the `pagedllm serve` arguments of every instance (one string, e.g. \"--model M\")"
    )
    ttft_slo: Optional[float] = arg(
        None, "refuse (503) a request whose predicted time to first token exceeds this (seconds)", type=_positive
    )
    tbt_slo: Optional[float] = arg(
        None, "refuse (503) a request whose predicted time between tokens exceeds this (seconds)", type=_positive
    )
    decode_max_num_seqs: int = arg(
        DEFAULT_MAX_NUM_SEQS,
        "the decode instances' --max-num-seqs: a stream beyond waits for a slot (the engine's default)",
        type=positive_int,
        metavar="N",
    )
    trace: Optional[str] = arg(
        None,
        "debug: append one JSON line per admitted streamed request (predicted and measured TTFT and its parts) to PATH",
        metavar="PATH",
    )


def add_proxy_parser(sub) -> None:
    p = sub.add_parser(
        "proxy",
        help="P/D disaggregation: route each request to a prefill instance, "
        "then a decode instance (both `pagedllm serve --kv-transfer-config`)",
    )
    add_dataclass_args(p, ProxyArgs)
    p.set_defaults(func=cmd_proxy)


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

    args = dataclass_from_args(ProxyArgs, ns)
    instances = None
    if args.launch_ray is not None:
        if args.prefill or args.decode:
            raise ValueError("--launch-ray starts the instances: give it without --prefill / --decode")
        from pagedllm.entrypoints.disagg_proxy.ray_launcher import LaunchSpec, RayInstances

        spec, serve_args = LaunchSpec.from_cli(args.launch_ray), _serve_args(args.serve_args)
        instances = RayInstances(spec, serve_args, name_prefix=f"pagedllm-proxy-{args.port}")
        args.prefill, args.decode = instances.prefill_urls, instances.decode_urls
        # uvicorn re-raises SIGTERM once it has stopped; Ray's driver handler would exit 15: end
        # with 0 instead, through the `finally` that stops the instances.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    elif not args.prefill or not args.decode:
        raise ValueError("give --prefill URL... and --decode URL... (or --launch-ray)")
    try:
        for url in args.prefill + args.decode:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--prefill / --decode take http(s) URLs, got {url!r}")
        app = build_app(
            args.prefill,
            args.decode,
            args.ttft_slo,
            args.tbt_slo,
            trace=args.trace,
            decode_max_num_seqs=args.decode_max_num_seqs,
        )
        freeze_gc_heap("proxy")
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if instances is not None:
            instances.shutdown()
    return 0
