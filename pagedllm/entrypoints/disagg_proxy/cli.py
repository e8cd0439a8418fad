"""`pagedllm proxy --port N --prefill URL... --decode URL... [--ttft-slo S] [--tbt-slo S]`."""
from __future__ import annotations

import argparse


def add_proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="P/D disaggregation: route each request to a prefill instance, "
                                     "then a decode instance (both `pagedllm serve --kv-transfer-config`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", nargs="+", required=True, help="prefill instances' base URLs (kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, help="decode instances' base URLs (kv_consumer)")
    p.add_argument("--ttft-slo", type=_positive, default=None,
                   help="refuse (503) a request whose predicted time to first token exceeds this (seconds)")
    p.add_argument("--tbt-slo", type=_positive, default=None,
                   help="refuse (503) a request whose predicted time between tokens exceeds this (seconds)")
    p.set_defaults(func=cmd_proxy)


def _positive(value: str) -> float:
    v = float(value)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value}")
    return v


def cmd_proxy(ns: argparse.Namespace) -> int:
    import uvicorn
    from pagedllm.entrypoints.disagg_proxy.app import build_app
    for url in ns.prefill + ns.decode:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--prefill / --decode take http(s) URLs, got {url!r}")
    app = build_app(ns.prefill, ns.decode, ns.ttft_slo, ns.tbt_slo)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0
