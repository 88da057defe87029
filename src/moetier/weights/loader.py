"""Loads non-expert weights of a family's module tree from a checkpoint, by name.

Builds the tree without allocating (meta device), then materializes each parameter on the
compute device straight from the checkpoint. Routed experts are skipped: the tiers own them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from tqdm.auto import tqdm

from moetier.errors import CheckpointError
from moetier.models.base import CausalLM
from moetier.models.registry import Family
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import dequantize_blocks, fp8_block

log = logging.getLogger(__name__)


def _source_name(ckpt: Checkpoint, name: str, family: Family) -> str | None:
    if name in ckpt:
        return name
    for ours, theirs in family.name_aliases:
        alias = name.replace(ours, theirs)
        if alias in ckpt:
            return alias
    return None


def _read_float(ckpt: Checkpoint, name: str, block: tuple[int, int]) -> torch.Tensor:
    """Tensor `name`; an FP8 weight is dequantized here with its block scales (non-expert
    weights are few: they are kept in the compute dtype)."""
    value = ckpt.read(name)
    if value.dtype != torch.float8_e4m3fn:
        return value
    scale = name + "_scale_inv"
    if scale not in ckpt:
        raise CheckpointError(
            f"{ckpt.model_dir}: FP8 tensor {name!r} has no {scale!r}; moetier reads FP8 "
            f"checkpoints with block scales (quantization_config.weight_block_size)"
        )
    return dequantize_blocks(value, ckpt.read(scale), block)


def build_model(
    family: Family,
    config: Any,
    ckpt: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
) -> CausalLM:
    """Build the family's model on `device` in `dtype` with every non-expert weight loaded."""
    with torch.device("meta"):
        model = family.build(config)
    model.to_empty(device=device)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    entries = list(params.items()) + list(model.named_buffers())
    loaded: set[str] = set()
    block = fp8_block(config)
    bar = tqdm(entries, desc="Loading weights", unit="tensor", disable=not progress)
    for name, tensor in bar:
        src = _source_name(ckpt, name, family)
        if src is None:
            if name == "lm_head.weight" and (tied or "lm_head.weight" not in ckpt):
                continue  # tied below
            raise CheckpointError(
                f"{ckpt.model_dir}: tensor {name!r} is missing from the checkpoint (is it a "
                f"{family.name} checkpoint, saved completely?)"
            )
        value = _read_float(ckpt, src, block)
        if tuple(value.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{ckpt.model_dir}: tensor {src!r} has shape {tuple(value.shape)}, the config "
                f"implies {tuple(tensor.shape)}"
            )
        target_dtype = dtype if tensor.dtype.is_floating_point and name in params else tensor.dtype
        with torch.no_grad():
            tensor.data = value.to(device=device, dtype=target_dtype)
        loaded.add(src)
    if "lm_head.weight" not in loaded and _source_name(ckpt, "lm_head.weight", family) is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model
