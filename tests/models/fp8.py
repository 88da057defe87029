"""FP8 checkpoints for tests: a tiny float checkpoint quantized to e4m3 with block scales (the
DeepSeek-V3 / Qwen3-FP8 layout), and its exact dequantization for transformers to run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moetier.weights.formats import dequantize_blocks

E4M3_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] float -> (e4m3 values, float32 scale_inv per block): value x scale = w
    up to e4m3 rounding, each block's largest magnitude mapped to 448."""
    rows, cols = w.shape
    br, bc = block
    sr, sc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(sr * br, sc * bc)
    padded[:rows, :cols] = w.float()
    amax = padded.view(sr, br, sc, bc).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / E4M3_MAX  # [sr, sc]
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    values = (w.float() / full).to(torch.float8_e4m3fn)
    return values, scale


def _quantized(name: str, t: torch.Tensor) -> bool:
    """Which tensors an FP8 release stores in FP8: the linear layers' weights (experts, shared
    experts, attention and dense MLP projections); embeddings, norms, routers and the LM head
    stay float."""
    if t.dim() != 2 or not name.endswith(".weight"):
        return False
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
    return not any(s in name for s in skip)


def make_fp8(src: Path, dst: Path, ref: Path, block: tuple[int, int] = (16, 16)) -> None:
    """Write `dst` (FP8 with `weight_scale_inv`, quantization_config fp8) and `ref` (float32:
    each FP8 value times its block's scale, what moetier computes with) from float `src`."""
    tensors = load_file(str(src / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _quantized(name, t):
            values, scale = quantize_blocks(t, block)
            fp8[name], fp8[name + "_scale_inv"] = values, scale
            deq[name] = dequantize_blocks(values, scale, block)
        else:
            fp8[name] = deq[name] = t
    for out, sd in ((dst, fp8), (ref, deq)):
        shutil.copytree(src, out, dirs_exist_ok=True)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
