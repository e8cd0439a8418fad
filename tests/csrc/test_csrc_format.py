"""pagedllm/csrc's C++ is formatted by clang-format with the repository's .clang-format: a diff
fails here (run `clang-format -i pagedllm/csrc/*.cpp pagedllm/csrc/*.h` to fix it)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_csrc_is_clang_formatted():
    clang_format = pytest.importorskip("clang_format", reason="clang-format (PyPI) is in the test extras")
    files = sorted(str(p) for p in (ROOT / "pagedllm" / "csrc").iterdir() if p.suffix in (".cpp", ".h"))
    assert files, "no C++ sources found in pagedllm/csrc"
    out = subprocess.run(
        [
            clang_format.get_executable("clang-format"),
            f"--style=file:{ROOT / '.clang-format'}",
            "--dry-run",
            "--Werror",
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
