"""Every environment variable is declared once, in pagedllm/envs.py, and listed in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bPAGEDLLM_[A-Z0-9_]+\b")


def test_every_variable_the_package_names_is_declared_and_documented():
    named = {m for p in (ROOT / "pagedllm").rglob("*.py") for m in NAME.findall(p.read_text())}
    assert named == set(envs.VARIABLES), named ^ set(envs.VARIABLES)
    readme = set(NAME.findall((ROOT / "README.md").read_text()))
    assert set(envs.VARIABLES) <= readme, set(envs.VARIABLES) - readme
    # Read only through envs: no module of the package reads one from os.environ itself.
    readers = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "pagedllm").rglob("*.py")
        if re.search(r"environ(\.get)?\(?\[?[\"']PAGEDLLM_", p.read_text())
    ]
    assert readers == []


def test_values_are_read_when_asked_and_parsed(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_WORKER_CALL_TIMEOUT_S", raising=False)
    assert envs.PAGEDLLM_WORKER_CALL_TIMEOUT_S == 300.0
    monkeypatch.setenv("PAGEDLLM_WORKER_CALL_TIMEOUT_S", "2.5")
    assert envs.PAGEDLLM_WORKER_CALL_TIMEOUT_S == 2.5
    for raw, value in [(None, True), ("", True), ("0", False), ("1", True)]:
        if raw is None:
            monkeypatch.delenv("PAGEDLLM_CPU_DECODE_LOOP", raising=False)
        else:
            monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", raw)
        assert envs.PAGEDLLM_CPU_DECODE_LOOP is value
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", "many")
    with pytest.raises(ValueError, match=r"PAGEDLLM_WORKER_THREADS='many' is not valid: torch threads"):
        envs.PAGEDLLM_WORKER_THREADS
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NOT_A_VARIABLE
