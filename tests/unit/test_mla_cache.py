"""MLA caches the compressed latent: same tokens as the expanded K/V form, far fewer bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier import LLM, SamplingParams
from moetier.layers.mla import MLAttention
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_cache_matches_expanded(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = FAMILIES[family].checkpoint(tmp_path / family)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run() -> tuple[list[list[int]], int]:
        llm = LLM(str(path), device="cpu", dtype="float32", progress=False, num_kv_blocks=8)
        outs = llm.generate(PROMPTS, params)
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner.kv_cache.bytes()

    latent, latent_bytes = run()
    monkeypatch.setattr(MLAttention, "latent_cache", False)
    expanded, expanded_bytes = run()
    assert latent == expanded
    # tiny shape: latent 32 + rope 8 = 40 per token vs 4 heads x (k 24 + v 16) = 160
    assert expanded_bytes == 4 * latent_bytes
