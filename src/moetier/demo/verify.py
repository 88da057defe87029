"""Checking a built demo checkpoint through transformers against the dense model's answer."""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# peak RAM of load_float32 over the checkpoint's bytes (16x2 demo: ~7.8 GB for 2.5 GiB)
LOAD_RAM_FACTOR = 3.2


def greedy_ids(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's greedy continuation of prompt_ids (new tokens only; stops at EOS)."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def teacher_forced_argmax(model: Any, prompt_ids: list[int], answer_ids: list[int]) -> list[int]:
    """Argmax prediction at each answer position given the true prefix (one forward pass)."""
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0]
    start = len(prompt_ids) - 1
    return [int(t) for t in logits[start : start + len(answer_ids)].argmax(dim=-1)]


def load_float32(path: Path) -> Any:
    """AutoModelForCausalLM of a bfloat16 checkpoint, computing in float32 (eval mode).

    Loads in bfloat16, then casts: about half the time and two thirds the peak RAM of loading
    with dtype=float32 directly (transformers 5 merges experts at load). Same values either way.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).float().eval()


def _mixtral_argmax(path: Path, prompt_ids: list[int], expected_ids: list[int]) -> list[int]:
    """Teacher-forced argmax ids of the checkpoint at path, loaded in float32 as Mixtral."""
    model = load_float32(path)
    try:
        arch = type(model).__name__
        if arch != "MixtralForCausalLM":
            raise RuntimeError(f"checkpoint loads as {arch}, not MixtralForCausalLM")
        return teacher_forced_argmax(model, prompt_ids, expected_ids)
    finally:
        del model
        gc.collect()


def verify_checkpoint(path: Path, prompt_ids: list[int], expected_ids: list[int]) -> None:
    """Load path with AutoModelForCausalLM and check it predicts expected_ids in float32.

    Raises RuntimeError on any mismatch: the upcycled model must compute the dense model.
    """
    log.info("verifying %s through transformers", path.name)
    got = _mixtral_argmax(path, prompt_ids, expected_ids)
    if got != expected_ids:
        raise RuntimeError(
            f"upcycled checkpoint disagrees with the dense model: {got} != {expected_ids}"
        )


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages (0 when neither is known)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def check_index(path: Path, num_experts: int, top_k: int) -> None:
    """The config says num_experts / top_k and the index holds every layer's experts and router."""
    config = json.loads((path / "config.json").read_text())
    got = (config.get("num_local_experts"), config.get("num_experts_per_tok"))
    if got != (num_experts, top_k):
        raise RuntimeError(f"config has experts, top-k {got}, not {(num_experts, top_k)}")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    layers = int(config["num_hidden_layers"])
    for layer in range(layers):
        moe = f"model.layers.{layer}.block_sparse_moe"
        wanted = [f"{moe}.gate.weight"] + [
            f"{moe}.experts.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w2", "w3")
        ]
        missing = [n for n in wanted if n not in names]
        if missing:
            raise RuntimeError(f"index lacks {len(missing)} tensors, e.g. {missing[0]}")


def dense_agreement(path: Path, prompt_ids: list[int], expected_ids: list[int]) -> float:
    """Share of expected_ids a (perturbed) checkpoint predicts teacher-forced, in float32."""
    got = _mixtral_argmax(path, prompt_ids, expected_ids)
    return sum(a == b for a, b in zip(got, expected_ids)) / max(len(expected_ids), 1)
