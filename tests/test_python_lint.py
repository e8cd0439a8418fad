"""The Python is checked by ruff with pyproject.toml's rules (undefined and unused names,
pycodestyle's errors): a finding fails here (`ruff check --fix pagedllm tests tools` fixes most)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in the test extras (pip install -e '.[test]')"
    out = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", "pagedllm", "tests", "tools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_leaves_everything_as_it_is():
    """The Python is laid out by `ruff format` (pyproject.toml's [tool.ruff.format]); run it
    on pagedllm tests tools to mend a finding."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in the test extras (pip install -e '.[test]')"
    out = subprocess.run(
        [ruff, "format", "--check", "--no-cache", "pagedllm", "tests", "tools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
