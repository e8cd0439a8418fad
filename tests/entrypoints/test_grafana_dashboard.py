"""examples/grafana/pagedllm.json queries only series a real server's /metrics has (the shared tiny
server), and `--metrics-prefix vllm` renames every series to the vllm: names vLLM's dashboards
query, the rest of each name unchanged."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from prometheus_client import generate_latest

from server_utils import REPO

DASHBOARD = os.path.join(REPO, "examples", "grafana", "pagedllm.json")


def series_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}


def queried(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    var = dashboard["templating"]["list"][1]["query"]["query"]
    return {n for e in exprs + [var] for n in re.findall(r"pagedllm:[a-zA-Z0-9_]+", e)}


def test_dashboard_series_exist(tiny_shared_server):
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    names = queried(dashboard)
    assert len(names) >= 15, names
    have = series_names(httpx.get(tiny_shared_server.url + "/metrics", timeout=10).text)
    assert names <= have, sorted(names - have)


def test_metrics_prefix():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.metrics import EngineMetrics

    ours = series_names(generate_latest(EngineMetrics("m").registry).decode())
    theirs = series_names(generate_latest(EngineMetrics("m", prefix="vllm").registry).decode())
    assert theirs == {n.replace("pagedllm:", "vllm:") for n in ours} and "vllm:num_requests_running" in theirs
    assert build_parser().parse_args(["serve", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-prefix", "a-b"])
