"""Builds pagedllm/csrc's C++ files into one extension module on first use, with torch's
cpp_extension (cached under $TORCH_EXTENSIONS_DIR).

The extension's name carries a hash of the sources' and headers' content and the flags, so an
edit builds a fresh extension and an old build is never loaded for new code (no hand-bumped
`_v5`). The sources are copied into the build directory first, as load_inline does: checkouts
and installs of the same code share one build instead of rebuilding for each path. If the
build fails (no compiler or ninja, a compile error) or PAGEDLLM_NO_CPU_KERNELS is set, the
result is None, with a warning: callers keep their torch path, and `build_failures` says why.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

from pagedllm import envs

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = ("attention.cpp", "fused_ops.cpp", "decode_loop.cpp", "quant_ops.cpp", "bindings.cpp")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")

# Why each extension that was tried is not built (name -> reason): the tests fail with it
# where a compiler exists, instead of passing on the torch fallback.
build_failures: dict[str, str] = {}


def cxx_compiler() -> str | None:
    """Path of the C++ compiler cpp_extension would call ($CXX, else c++), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _files(src_dir: Path) -> list[Path]:
    """Every file a build of src_dir reads: its .cpp and .h files."""
    return sorted(p for p in src_dir.iterdir() if p.suffix in (".cpp", ".h"))


def extension_name(prefix: str, src_dir: Path, cflags=CFLAGS) -> str:
    """prefix + a hash of src_dir's sources and headers and the flags."""
    h = hashlib.sha256(" ".join(cflags).encode())
    for p in _files(src_dir):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return f"{prefix}_{h.hexdigest()[:16]}"


def _copy_if_changed(src: Path, dst: Path) -> None:
    """Write dst only where it differs: an unchanged mtime lets ninja skip the compile."""
    data = src.read_bytes()
    if not dst.exists() or dst.read_bytes() != data:
        dst.write_bytes(data)


def build_extension(prefix: str, src_dir: Path, sources, cflags=CFLAGS):
    """Compile src_dir's `sources` (their headers beside them) into one module -> the module,
    or None (with a warning; `build_failures[name]` says why)."""
    name = extension_name(prefix, src_dir, cflags)
    if envs.PAGEDLLM_NO_CPU_KERNELS:
        build_failures[name] = "PAGEDLLM_NO_CPU_KERNELS is set"
        return None
    try:
        from torch.utils import cpp_extension
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        # torch marks a build in progress with a `lock` file in the build directory, which a
        # build killed midway (Ctrl-C on the first start) leaves behind: every later start
        # would wait on it forever. Builds of ours take an OS lock first, which dies with its
        # process, so while we hold it any such file is stale.
        with open(build_dir / ".pagedllm-build.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing the lock of an interrupted build of %s", name)
                stale.unlink()
            for p in _files(src_dir):
                _copy_if_changed(p, build_dir / p.name)
            return cpp_extension.load(
                name=name, sources=[str(build_dir / s) for s in sources], extra_cflags=list(cflags),
                build_directory=str(build_dir), verbose=False)
    except Exception as e:
        build_failures[name] = f"{type(e).__name__}: {e}"
        logger.warning("C++ kernels %s not built (%s); using the slower torch path", name, e)
        return None


@functools.cache
def cpu_extension():
    """The one extension of pagedllm/csrc (paged_decode, rms_norm, silu_and_mul,
    rotary_embedding_, linear_small, quant_linear, decode_layers), or None; built at most once a process."""
    return build_extension("pagedllm_cpu", SOURCE_DIR, SOURCES)


if __name__ == "__main__":
    # `make test` / `make serve` build the kernels ahead, so the first engine (or test) does not
    # wait for the compiler; a failed build is reported, not fatal (the engine has its torch path).
    logging.basicConfig(level=logging.INFO)
    ext = cpu_extension()
    print(f"C++ kernels: {ext.__name__ if ext is not None else 'not built: ' + '; '.join(build_failures.values())}")
