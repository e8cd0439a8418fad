"""Builds pagedllm/csrc's C++ files into one extension module on first use, with torch's
cpp_extension (cached under $TORCH_EXTENSIONS_DIR).

The extension's name carries a hash of the sources' and headers' content and the flags, so an
edit builds a fresh extension and an old build is never loaded for new code (no hand-bumped
`_v5`). The sources are copied into the build directory first, as load_inline does: checkouts
and installs of the same code share one build instead of rebuilding for each path. If the
build fails (no compiler or ninja, a compile error) or PAGEDLLM_NO_CPU_KERNELS is set, the
result is None, with a warning: callers keep their torch path, and `build_failures` says why.

One build per ISA level (`VARIANTS`, as vLLM's _C_AVX2 / _C_AVX512 and ggml's CPU variants):
the kernels' `#ifdef __AVX512F__` / `__AVX2__` paths are each compiled by the variant whose flags
enable them, so an AVX-512 machine builds (and its tests run) the AVX2 path too. The variant a
process uses is the best the CPU runs (`runnable_isas`, from /proc/cpuinfo's flags), or
$PAGEDLLM_CPU_ISA; a non-x86 machine has one variant, "native" (-march=native).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from typing import NamedTuple

from pagedllm import envs

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = (
    "attention.cpp",
    "prefill_attention.cpp",
    "fused_ops.cpp",
    "bf16_linear.cpp",
    "decode_loop.cpp",
    "gguf_decode_step.cpp",
    "quant_ops.cpp",
    "gguf_linear.cpp",
    "gguf_int8.cpp",
    "argmax.cpp",
    "bindings.cpp",
)
BASE_CFLAGS = ("-O3", "-ffast-math", "-fopenmp")
CFLAGS = BASE_CFLAGS + ("-march=native",)


class Variant(NamedTuple):
    flags: tuple  # the compiler's ISA flags
    cpu_flags: tuple  # /proc/cpuinfo flags the code compiled so needs


# Best first. x86-64-v3: AVX2, FMA, F16C, BMI1/2 (Haswell, Zen 1); x86-64-v4: AVX-512 F/BW/CD/
# DQ/VL, and VNNI (vpdpwssd) and BF16 (vdpbf16ps) on top (Cooper Lake, Sapphire Rapids, Zen 4).
VARIANTS = {
    "avx512": Variant(
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        (
            "avx2",
            "fma",
            "f16c",
            "bmi2",
            "avx512f",
            "avx512bw",
            "avx512cd",
            "avx512dq",
            "avx512vl",
            "avx512_vnni",
            "avx512_bf16",
        ),
    ),
    "avx2": Variant(("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi1", "bmi2")),
}
NATIVE = "native"  # a CPU that runs none of VARIANTS (not x86): one build for the machine at hand

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
                name=name,
                sources=[str(build_dir / s) for s in sources],
                extra_cflags=list(cflags),
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as e:
        build_failures[name] = f"{type(e).__name__}: {e}"
        logger.warning("C++ kernels %s not built (%s); using the slower torch path", name, e)
        return None


@functools.cache
def _cpu_flags() -> frozenset:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_isas() -> list[str]:
    """The variants this CPU can run, best first (["native"] off x86 or without /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [NATIVE]
    flags = _cpu_flags()
    isas = [name for name, v in VARIANTS.items() if flags.issuperset(v.cpu_flags)]
    return isas or [NATIVE]


def selected_isa() -> str:
    """$PAGEDLLM_CPU_ISA, else the best variant this CPU runs; ValueError for one it cannot run."""
    isas = runnable_isas()
    forced = envs.PAGEDLLM_CPU_ISA
    if forced is None:
        return isas[0]
    if forced not in isas:
        raise ValueError(
            f"PAGEDLLM_CPU_ISA={forced!r}: this CPU runs {', '.join(isas)} "
            f"(the variants: {', '.join(list(VARIANTS) + [NATIVE])})"
        )
    return forced


def isa_cflags(isa: str) -> tuple:
    return CFLAGS if isa == NATIVE else BASE_CFLAGS + VARIANTS[isa].flags


@functools.cache
def isa_extension(isa: str):
    return build_extension(f"pagedllm_cpu_{isa}", SOURCE_DIR, SOURCES, isa_cflags(isa))


def cpu_extension():
    """The extension of pagedllm/csrc (paged_decode, paged_prefill, rms_norm, silu_and_mul, rotary_embedding_,
    linear_small, quant_linear, decode_layers) built for `selected_isa()`, or None; each variant is
    built at most once a process."""
    return isa_extension(selected_isa())


if __name__ == "__main__":
    # `make test` / `make serve` build the kernels ahead, so the first engine (or test) does not
    # wait for the compiler; a failed build is reported, not fatal (the engine has its torch path).
    # Every variant this CPU runs: the tests run each of them.
    logging.basicConfig(level=logging.INFO)
    for isa in runnable_isas():
        ext = isa_extension(isa)
        print(
            f"C++ kernels ({isa}): {ext.__name__ if ext is not None else 'not built: ' + '; '.join(build_failures.values())}"
        )
