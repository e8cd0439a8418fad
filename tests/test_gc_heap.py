"""The start-up heap is frozen out of the cyclic GC's walks in the processes that serve (the
engine core and the API server, as vLLM's engine core does): an oldest-generation collection
then walks what was made since start-up, not the ~0.4 M objects of torch, transformers and the
model (~165 ms a walk at rest on this project's machine, every request in flight waiting)."""

from __future__ import annotations

import re
import subprocess
import sys

from server_utils import REPO


def test_freeze_takes_the_start_up_heap_out_of_the_walks():
    # In a process of its own: freezing the test process would keep its cyclic garbage for good.
    code = (
        "import gc, torch, transformers.models.llama.modeling_llama\n"
        "from pagedllm.gc_heap import freeze_gc_heap\n"
        "before = len(gc.get_objects())\n"
        "n = freeze_gc_heap('test')\n"
        "print(before, n, len(gc.get_objects()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, frozen, after = map(int, out.stdout.split())
    assert frozen > 100_000 and frozen >= 0.9 * before, (before, frozen)
    assert after < 0.01 * before, (before, after)  # what a full collection walks now


def test_server_processes_freeze_after_start_up(tiny_shared_server):
    log = tiny_shared_server.log_text()
    for what in ("engine core", "API server"):
        m = re.search(rf"{what}: (\d+) start-up objects frozen", log)
        assert m and int(m.group(1)) > 100_000, (what, log[-2000:])
