"""Rotary position embeddings (HF-compatible inverse frequencies, rotate-half application)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.kernels.rmsnorm_rope import rope, rope_reference


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope settings as a dict with at least rope_type and rope_theta (those of
    `layer_type` where the config keys them by layer type, as Gemma 4's)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params if layer_type is None else params[layer_type])
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


# Distinct (inverse frequencies, scaling) tables -> small ids, so a step cache key is cheap.
_TABLE_IDS: dict[tuple[tuple[float, ...], float], int] = {}
# cos/sin of the positions tensor of the current step, shared by all layers of the step.
_STEP_CACHE: dict[object, Any] = {}


class RotaryEmbedding(nn.Module):
    """cos/sin tables for `dim` rotary channels; non-default rope types use transformers' math.

    layer_type: the config keys its rope settings by layer type (Gemma 4: sliding and full
    attention layers rotate with their own theta, type and head size); transformers' init
    functions get it too."""

    def __init__(self, config: Any, dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        if params["rope_type"] == "default":
            base = float(params["rope_theta"])
            arange = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
            inv_freq = 1.0 / (base ** (arange / dim))
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # Models are built under torch.device("meta"); transformers' rope math creates some
            # tensors without a device, so pin the default device to compute real values.
            with torch.device("cpu"):
                init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
                if layer_type is None:
                    inv_freq, self.scaling = init(config, "cpu")
                else:
                    inv_freq, self.scaling = init(config, "cpu", layer_type=layer_type)
        # A plain attribute, not a buffer: models are built on the meta device and this table is
        # computed, not loaded. Moved to the compute device on first use.
        self.inv_freq = inv_freq.float().to("cpu")
        self.fused = False  # rotate() as one Triton kernel (set by the model runner)
        table_key = (tuple(self.inv_freq.tolist()), float(self.scaling))
        self._table_id = _TABLE_IDS.setdefault(table_key, len(_TABLE_IDS))

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, dim] for int positions [T].

        Every layer of a step passes the same positions tensor: the first layer computes the
        tables, the others reuse them (one entry per distinct table and dtype).
        """
        if _STEP_CACHE.get("positions") is not positions:
            _STEP_CACHE.clear()
            _STEP_CACHE["positions"] = positions  # held, so its identity is not reused
        key = (self._table_id, dtype)
        hit = _STEP_CACHE.get(key)
        if hit is None:
            hit = _STEP_CACHE[key] = self._compute(positions, dtype)
        return hit

    def _compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, d] rotated by this step's cos/sin [T, r]; with partial rotary (r < d, GLM's
        partial_rotary_factor) only the first r channels rotate and the rest pass through."""
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return rope(x, cos, sin, self.fused)
        return torch.cat((rope(x[..., :rot], cos, sin, self.fused), x[..., rot:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] rotated by cos/sin [T, d]."""
    return rope_reference(x, cos, sin)
