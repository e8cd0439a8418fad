"""keep_freed_memory: with glibc's thresholds set, a step's freed activations keep their pages,
so the next step's outputs take no page faults; counted by the kernel (getrusage's minor
faults) in a fresh process each, beside a process with glibc's defaults that does fault (so
the count can tell them apart on this machine)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's malloc only"
)

# Three outputs at once, freed, four times over (a prefill layer's gate_up outputs):
# -> the minor faults of each round. With the thresholds set the heap settles after two rounds
# and the last takes no fresh page. With glibc's defaults round 1's blocks are mmapped and
# unmapped when freed, so round 2's at least come from fresh pages (whether later rounds trim
# the heap depends on what else it holds, so they are not counted on alone).
# COLUMNS: 3072 (12 MiB blocks, under glibc's largest mmap threshold) or 16384 (64 MiB: a 1B
# model's gate_up output, over it).
SCRIPT = """
import resource, sys, torch
from pagedllm.worker.cpu_malloc import keep_freed_memory
print(keep_freed_memory())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
for _ in range(4):
    before = faults()
    outs = [torch.empty(2048, COLUMNS, dtype=torch.bfloat16).fill_(1) for _ in range(3)]
    del outs
    rounds.append(faults() - before)
print(*rounds)
"""


def pages(columns: int) -> int:
    return 3 * 2048 * columns * 2 // 4096


def run(keep: str, columns: int) -> tuple[str, list[int]]:
    env = dict(os.environ, PAGEDLLM_CPU_MALLOC_KEEP=keep)
    script = SCRIPT.replace("COLUMNS", str(columns))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    applied, *faults = out.stdout.split()
    return applied, [int(f) for f in faults]


@pytest.mark.parametrize("columns", [3072, 16384])
def test_freed_activations_are_reused_without_page_faults(columns):
    applied, faults = run("1", columns)
    assert applied == "True"
    assert faults[-1] < pages(columns) // 20, faults


@pytest.mark.parametrize("columns", [3072, 16384])
def test_switched_off_glibc_defaults_fault_on_every_page(columns):
    applied, faults = run("0", columns)
    assert applied == "False"
    assert sum(faults[1:]) > pages(columns) // 2, faults  # what the thresholds save
