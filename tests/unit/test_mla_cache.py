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


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_fresh_prompt_steps_attend_in_the_expanded_form(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of fresh prompts attends in the expanded form on the CPU by default (flash-sized
    heads on CUDA, where it is off until timed), every other step (decode rows, a later chunk
    of a prompt) in the absorbed form over the cached latent; the tokens equal those with every
    step absorbed."""
    import moetier.layers.mla as mla

    path = FAMILIES[family].checkpoint(tmp_path / family)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    calls = {"fresh": 0, "latent": 0}
    for name, key in (("_attend_fresh", "fresh"), ("_attend_latent", "latent")):
        inner = getattr(MLAttention, name)

        def spy(self, *args, _inner=inner, _key=key):  # type: ignore[no-untyped-def]
            calls[_key] += 1
            return _inner(self, *args)

        monkeypatch.setattr(MLAttention, name, spy)

    def run() -> list[list[int]]:
        llm = LLM(
            str(path), device="cpu", dtype="float32", progress=False, max_num_batched_tokens=8
        )
        outs = llm.generate(PROMPTS, params)
        return [o.outputs[0].token_ids for o in outs]

    assert mla.EXPANDED_FRESH is True  # the default
    expanded = run()
    layers = 3  # the tiny checkpoint's attention layers
    # the first step holds the first 8 prompt tokens of fresh prompts only; later chunks and
    # decode rows read the cache
    assert calls["fresh"] >= layers and calls["fresh"] % layers == 0
    assert calls["latent"] > 0
    calls.update(fresh=0, latent=0)
    monkeypatch.setattr(mla, "EXPANDED_FRESH", False)
    absorbed = run()
    assert calls["fresh"] == 0
    assert expanded == absorbed
