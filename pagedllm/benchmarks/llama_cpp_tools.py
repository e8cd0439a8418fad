"""llama.cpp's own command-line tools, built once from the llama.cpp that the llama-cpp-python
sdist vendors, for side-by-side figures on the same GGUF file (`bench latency --llama-cpp
FILE`, `bench perplexity --llama-cpp`).

`make llama-cpp` (or `python -m pagedllm.benchmarks.llama_cpp_tools`) downloads the sdist with
pip, unpacks its vendor/llama.cpp into $PAGEDLLM_HOME/llama.cpp-<version>/ and builds there
with cmake (Release, -DGGML_NATIVE=ON: the machine's own ISA, as a user's build would be);
the binaries land in its build/bin/. A later call builds only the tools that are missing.
About 15 minutes on 2 cores, most of it libllama and ggml, shared by every tool.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pagedllm.envs import pagedllm_home

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist's vendor/llama.cpp: the llama.cpp compared against
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity", "llama-tokenize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)


def source_dir() -> Path:
    """Where the llama.cpp tree is unpacked and built (build/ inside it)."""
    return pagedllm_home() / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def tool_path(name: str) -> Path:
    if name not in TOOLS:
        raise ValueError(f"llama.cpp tool must be one of {', '.join(TOOLS)}, got {name!r}")
    return source_dir() / "build" / "bin" / name


def missing_tools(names=TOOLS) -> list[str]:
    return [n for n in names if not os.access(tool_path(n), os.X_OK)]


def find_tool(name: str) -> Path:
    """The built tool's path; RuntimeError saying how to build it when it is not there."""
    path = tool_path(name)
    if not os.access(path, os.X_OK):
        raise RuntimeError(
            f"llama.cpp's {name} is not built (looked for {path}); build llama.cpp's tools "
            "once with `make llama-cpp` (python -m pagedllm.benchmarks.llama_cpp_tools, ~15 min)"
        )
    return path


def _unpack_sdist(dest: Path) -> None:
    """pip downloads the llama-cpp-python sdist (no wheel: the source is what is wanted);
    its vendor/llama.cpp/ becomes dest."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                tmp,
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            ],
            check=True,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            staging = dest.with_name(dest.name + ".unpacking")
            shutil.rmtree(staging, ignore_errors=True)
            tar.extractall(staging, members=members, filter="data")
        os.replace(staging, dest)


def build(names=TOOLS, jobs: int | None = None) -> dict[str, Path]:
    """Build the tools that are missing (unpacking and configuring first if needed) -> their paths."""
    src = source_dir()
    todo = missing_tools(names)
    if todo:
        if shutil.which("cmake") is None:
            raise RuntimeError("building llama.cpp's tools needs cmake and a C++ compiler on PATH")
        if not (src / "CMakeLists.txt").is_file():
            src.parent.mkdir(parents=True, exist_ok=True)
            _unpack_sdist(src)
        if not (src / "build" / "CMakeCache.txt").is_file():
            subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *CMAKE_FLAGS], check=True)
        subprocess.run(
            ["cmake", "--build", str(src / "build"), "--target", *todo, "-j", str(jobs or os.cpu_count() or 1)],
            check=True,
        )
    return {n: find_tool(n) for n in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the cores)")
    ns = p.parse_args(argv)
    for name, path in build(ns.tools, ns.jobs).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
