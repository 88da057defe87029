"""The int8 KV cache against an independent reference: transformers' own attention with its K
and V quantized per (token, head) in numpy (engine/kv_cache.py's format written from its
definition, none of its code). moetier's int8 prompt logits equal that reference's, so however
far int8 moves a family's logits, the format moved them, not the way a layer writes or reads
the cache (checked: a prefill attending to fresh K/V, or scales over all heads of a token,
fails it by 0.04 to 2.8).

Gemma 4 is the case that asked for it (issue #23): int8 moves its tiny checkpoint's logits by
0.96 on the 13-token prompt. The reference moves them by the same 0.96. The cause is the
random checkpoint: its layer-3 router is near uniform over 8 experts, and at that prompt's last
token the 2nd and 3rd experts differ by 8e-5 in probability (0.12596 against 0.12588). The
int8 error (about 5e-4 there) swaps them, and the swapped-in expert carries a weight of 0.07
instead of 0.41; with that one token's layer-3 routing pinned to the exact cache's, the shift is
0.32. The H100 run that reported 0.17 for the same test was the test's earlier form, which
stopped at the first prompt past its bound: 0.17 is the 6-token prompt's shift on both devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from moetier import LLM
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS, hf_last_logits, hf_model

_INT8_REF = "moetier_int8_kv_reference"


def _int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, L, d] -> the same, each (token, head) vector quantized and dequantized:
    scale = float32(absmax / 127) (1 for all zeros), q = round-half-even(x / scale) clamped
    to +-127, then q * scale; float32 arithmetic throughout."""
    a = x.detach().cpu().numpy().astype(np.float32)
    amax = np.abs(a).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(a / scale), -127, 127).astype(np.float32)
    return torch.from_numpy(q * scale).to(x.device)


def _int8_sdpa(
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    # A prompt's forward without a cache: every key and value it attends to is this step's,
    # as moetier's prefill reads them back from the int8 pool.
    return sdpa_attention_forward(module, q, _int8_round_trip(k), _int8_round_trip(v), *a, **kw)


AttentionInterface.register(_INT8_REF, _int8_sdpa)
# the masks of SDPA (a name without a mask function gets none: no sliding window, no causality)
AttentionMaskInterface.register(_INT8_REF, sdpa_mask)


@pytest.mark.parametrize("family", ["gemma4", "qwen3_moe"])
def test_int8_logits_equal_transformers_with_reference_int8_kv(family: str, tmp_path: Path) -> None:
    """Every prompt's last logits: moetier int8 == transformers + reference int8 within 1e-5
    (measured 4.8e-7, float32 rounding, as the exact caches agree); the same shift from the
    exact logits on both (gemma4: 0.172, 0.046, 0.957; qwen3_moe: 0.033, 0.031, 0.028)."""
    path = FAMILIES[family].checkpoint(tmp_path / family)
    hf = hf_model(path)
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", progress=False)
    exact, lossy = LLM(str(path), **kw), LLM(str(path), kv_cache_dtype="int8", **kw)
    for prompt in PROMPTS:
        hf.set_attn_implementation("sdpa")
        ref_exact = hf_last_logits(hf, prompt)
        hf.set_attn_implementation(_INT8_REF)
        ref_int8 = hf_last_logits(hf, prompt)
        got_exact, got_int8 = exact.prompt_logits(prompt), lossy.prompt_logits(prompt)
        torch.testing.assert_close(got_exact, ref_exact, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_int8, ref_int8, atol=1e-5, rtol=0)
        assert (ref_int8 - ref_exact).abs().max() > 1e-3  # the reference quantized too
