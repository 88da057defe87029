"""KV cache storage formats: int8 quantize/dequantize against a reference with exact scales,
attention over an int8 cache against the float32 cache, bytes per token per format, and the
greedy tokens of tiny random checkpoints with int8 against the default (exact) cache."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from moetier import LLM, SamplingParams
from moetier.engine.block_manager import BlockManager
from moetier.engine.kv_cache import (
    KV_FORMATS,
    LayerKV,
    PagedKVCache,
    dequantize_int8,
    kv_bytes_per_token,
    kv_layout,
    quantize_int8,
)
from moetier.errors import ConfigError
from moetier.layers.attention import attend
from moetier.layers.context import ForwardContext, SeqSpan
from moetier.models.registry import get_family
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS

CPU = torch.device("cpu")


def _reference_int8(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per vector (last dim): scale = float32(absmax / 127), q = round-half-even(x / scale) in
    float32 arithmetic, clamped to [-127, 127]; scale 1 for an all-zero vector."""
    xs = x.double().numpy().astype(np.float32).reshape(-1, x.shape[-1])
    scales = np.empty(len(xs), dtype=np.float32)
    qs = np.empty(xs.shape, dtype=np.int8)
    for i, row in enumerate(xs):
        amax = np.float32(np.abs(row).max())
        scale = np.float32(amax / np.float32(127)) if amax > 0 else np.float32(1)
        scales[i] = scale
        qs[i] = np.clip(np.rint(row / scale), -127, 127).astype(np.int8)
    return qs.reshape(x.shape), scales.reshape(x.shape[:-1])


def test_quantize_matches_reference_with_exact_scales() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 24, generator=g) * torch.rand(7, 3, 1, generator=g) * 10  # [T, H, d]
    x[2, 1] = 0.0  # an all-zero head vector
    q, s = quantize_int8(x)
    ref_q, ref_s = _reference_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (7, 3)
    assert np.array_equal(s.numpy(), ref_s)  # bit-exact scales
    assert np.array_equal(q.numpy(), ref_q)
    assert s[2, 1] == 1.0 and q[2, 1].abs().sum() == 0
    # each vector's absmax maps to +-127 exactly; every entry is within half a step
    amax = x.abs().amax(-1)
    assert (q.abs().amax(-1)[amax > 0] == 127).all()
    err = (dequantize_int8(q, s, torch.float32) - x).abs()
    assert (err <= s[..., None] / 2 * (1 + 1e-6)).all()


def test_block_fills_token_by_token_without_requantizing() -> None:
    """Per-token scales: a later, larger token in the same block leaves earlier tokens' bytes
    as they were written (a per-block scale would have to re-quantize them)."""
    m = BlockManager(num_blocks=2, block_size=4)
    cache = PagedKVCache(m, CPU, {0: LayerKV((1, 8), (1, 8))}, KV_FORMATS["int8"])
    small = torch.linspace(-0.1, 0.1, 8).view(1, 1, 8)
    cache.write(0, small, small, torch.tensor([0]))
    before = cache.read(0, torch.tensor([0]), torch.float32)[0].clone()
    cache.write(0, 100 * small, small, torch.tensor([1]))  # slot 1: same block
    after, v = cache.read(0, torch.tensor([0, 1]), torch.float32)
    assert v is not None
    assert torch.equal(after[:1], before)
    ref_q, ref_s = _reference_int8(small)
    assert torch.equal(before, torch.from_numpy(ref_q.astype(np.float32) * ref_s[..., None]))
    assert torch.allclose(after[1], 100 * small[0], atol=10 / 254 + 1e-6, rtol=0)


def _attend_two_steps(fmt: str, seed: int = 0) -> list[torch.Tensor]:
    """Step 1: seq 0 prefills 10 tokens. Step 2: seq 0 decodes one token (past 10) and seq 1
    prefills 5. GQA: 4 query heads over 2 KV heads, d 16. Returns both steps' outputs."""
    g = torch.Generator().manual_seed(seed)
    m = BlockManager(num_blocks=8, block_size=4)
    cache = PagedKVCache(m, CPU, {0: LayerKV((2, 16), (2, 16))}, KV_FORMATS[fmt])
    outs = []
    for step in ([(0, 0, 10)], [(0, 10, 1), (1, 0, 5)]):
        spans, positions, start = [], [], 0
        for seq, past, n in step:
            m.allocate(seq, past + n)
            spans.append(SeqSpan(seq, start, start + n, past))
            positions.extend(range(past, past + n))
            start += n
        ctx = ForwardContext(spans, torch.tensor(positions), cache, cache.build_batch(step, start))
        q = torch.randn(start, 4, 16, generator=g)
        k, v = torch.randn(start, 2, 16, generator=g), torch.randn(start, 2, 16, generator=g)
        outs.append(attend(ctx, 0, q, k, v, 16**-0.5))
    return outs


def test_attention_over_int8_cache_is_close_to_float32() -> None:
    """K and V entries are off by at most absmax / 254 (0.4% of a head vector's largest entry);
    with unit-normal K/V, d 16, the attention outputs (up to ~3.5) moved by at most 0.0127
    (seed 0; 0.0145 over seeds 0-4, measured). Tolerance atol 0.03, rtol 0: about 2x the
    worst measured error, far below what a wrong scale or a wrong slot gives (order 1)."""
    exact, lossy = _attend_two_steps("fp32"), _attend_two_steps("int8")
    for a, b in zip(exact, lossy):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=0.03, rtol=0)
        assert not torch.equal(a, b)  # it is lossy: the int8 path really ran


# Qwen3-30B-A3B (48 layers, 4 KV heads of 128) and DeepSeek-V3 (61 layers, latent 512 + rope 64)
_QWEN3_30B = {i: LayerKV((4, 128), (4, 128)) for i in range(48)}
_DEEPSEEK_V3 = {i: LayerKV((1, 576), None) for i in range(61)}


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (_QWEN3_30B, {"fp32": 196608, "bf16": 98304, "fp16": 98304, "int8": 50688}),
        (_DEEPSEEK_V3, {"fp32": 140544, "bf16": 70272, "fp16": 70272, "int8": 35380}),
    ],
    ids=["qwen3-30b-a3b", "deepseek-v3"],
)
def test_bytes_per_token_per_format(layout: dict[int, LayerKV], expected: dict[str, int]) -> None:
    # int8: 1 byte per channel + a 4-byte float32 scale per (token, head) of K and of V
    assert {f: kv_bytes_per_token(layout, KV_FORMATS[f]) for f in expected} == expected


# qwen3_moe: 3 layers x (K + V) x 2 KV heads x 32 channels; int8: (32 + 4) bytes a head vector.
# deepseek_v3: 3 layers x one latent head of 32 + 8 (rope) channels, no separate V.
_TINY_BYTES = {
    "qwen3_moe": {"fp32": 1536, "bf16": 768, "fp16": 768, "int8": 432},
    "deepseek_v3": {"fp32": 480, "bf16": 240, "fp16": 240, "int8": 132},
}


@pytest.mark.parametrize(
    ("family", "arch"),
    [("qwen3_moe", "Qwen3MoeForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM")],
)
def test_bytes_per_token_of_tiny_families(family: str, arch: str) -> None:
    expected, fam = _TINY_BYTES[family], FAMILIES[family]
    config = AutoConfig.for_model(fam.model_type, architectures=[arch], **{**fam.tiny, **fam.main})
    with torch.device("meta"):
        model = get_family(config).build(config)
    layout = kv_layout(model)
    assert {f: kv_bytes_per_token(layout, KV_FORMATS[f]) for f in expected} == expected


# Greedy agreement of int8 with the exact cache over PROMPTS x 32 new tokens (float32, CPU):
# tokens before each prompt's first divergence, over all 96. Measured 65/96 (qwen3_moe: first
# divergences at 32, 1, 32) and 52/96 (deepseek_v3, MLA latent: 14, 32, 6). Random tiny models
# have logit margins of hundredths (max |logit| ~3.6), so a 0.04 shift flips near-ties; the
# bounds below are the measured shares, not a claim about real checkpoints.
_AGREEMENT = {"qwen3_moe": 65, "deepseek_v3": 52}


@pytest.fixture(scope="module", params=sorted(_AGREEMENT))
def tiny_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp("kv") / request.param)


def _llm(path: Path, kv_cache_dtype: str) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        progress=False,
        num_kv_blocks=16,
        kv_cache_dtype=kv_cache_dtype,
    )


def test_int8_logits_and_greedy_tokens_against_the_exact_cache(
    tiny_ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Prompt logits within atol 0.08 (measured max |delta| 0.034 qwen3_moe, 0.040
    deepseek_v3, over logits up to 3.6: about 2x margin); greedy tokens agree up to the
    measured first divergences."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    exact = _llm(tiny_ckpt, "auto")
    with caplog.at_level(logging.INFO, logger="moetier.engine.kv_cache"):
        lossy = _llm(tiny_ckpt, "int8")
    assert "in int8 (float32 scale per token and head)" in caplog.text, caplog.text
    for prompt in PROMPTS:
        a, b = exact.prompt_logits(prompt), lossy.prompt_logits(prompt)
        torch.testing.assert_close(b, a, atol=0.08, rtol=0)
    ref = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in lossy.generate(PROMPTS, params)]
    agree = 0
    for r, t in zip(ref, got):
        agree += next((i for i, (x, y) in enumerate(zip(r, t)) if x != y), len(r))
    assert agree >= _AGREEMENT[tiny_ckpt.name], (agree, ref, got)
    # the effective format, everywhere it is reported
    assert exact.offload_stats()["kv_cache_dtype"] == "fp32"  # auto = the model dtype
    stats = lossy.offload_stats()
    assert stats["kv_cache_dtype"] == "int8"
    assert stats["kv_bytes_per_token"] == _TINY_BYTES[tiny_ckpt.name]["int8"]
    assert stats["kv_cache_bytes"] == 16 * 16 * stats["kv_bytes_per_token"]
    assert lossy.engine.stats()["kv_bytes_per_token"] == stats["kv_bytes_per_token"]


def test_unknown_kv_cache_dtype_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'fp4'; choose one of auto"):
        LLM(str(tmp_path / "missing"), device="cpu", kv_cache_dtype="fp4")


def test_metrics_export_the_format_and_bytes() -> None:
    from prometheus_client import generate_latest

    from moetier.metrics import ServerMetrics

    metrics = ServerMetrics("m", kv_cache_dtype="int8")
    metrics.update_engine({"kv_bytes_per_token": 432.0, "kv_cache_bytes": 110592.0})
    text = generate_latest(metrics.registry).decode()
    assert 'moetier:kv_cache_info{kv_cache_dtype="int8",model_name="m"} 1.0' in text, text
    assert 'moetier:kv_cache_bytes_per_token{model_name="m"} 432.0' in text, text
    assert 'moetier:kv_cache_bytes{model_name="m"} 110592.0' in text, text
