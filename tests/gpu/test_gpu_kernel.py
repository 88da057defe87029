"""The slot-reading expert kernel on CUDA equals its PyTorch reference (kernels/expert_ffn.py).

fp32: equal to float tolerance. bf16: the kernel's dot products accumulate in a different order
than cuBLAS, so a rounded intermediate may differ by one unit in the last place; the largest
difference must stay within a few bf16 ulps of the output's scale. Run on the GPU machine with
`bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.expert_ffn import expert_ffn, expert_ffn_reference, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (T tokens, K, D, I, S slots): Qwen3-30B-A3B and DeepSeek-V2-Lite decode shapes, a batch-4
# step and ragged sizes that exercise the masks.
SHAPES = [(1, 8, 2048, 768, 40), (1, 6, 2048, 1408, 20), (4, 8, 2048, 768, 64), (3, 2, 200, 72, 7)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert triton_available()
    t, k, d, i, s = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, d, generator=g, device="cuda").to(dtype)
    pool = (torch.randn(s, 3 * i * d, generator=g, device="cuda") / d**0.5).to(dtype)
    slots = torch.stack([torch.randperm(s, device="cuda", generator=g)[:k] for _ in range(t)])
    slots = slots.sort(dim=-1).values
    w = torch.rand(t, k, generator=g, device="cuda")
    got = expert_ffn(x, pool, slots, w, i).float()
    want = expert_ffn_reference(x, pool, slots, w, i).float()
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"largest difference {err:.3g} of the output's scale"


@pytest.mark.parametrize("shape", SHAPES)
def test_every_launch_shape_matches_reference(shape: tuple[int, ...]) -> None:
    """The chosen launch shape and both down-projection variants: within the bf16 tolerance of
    the reference, and the split variant bit-equal to the one-kernel variant at equal tiles (the
    same dot products, the same ordered, rounded adds)."""
    from moetier.kernels._expert_ffn_triton import FfnConfig, choose_config, expert_ffn_triton

    t, k, d, i, s = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
    pool = (torch.randn(s, 3 * i * d, generator=g, device="cuda") / d**0.5).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(s, device="cuda", generator=g)[:k] for _ in range(t)])
    slots = slots.sort(dim=-1).values
    w = torch.rand(t, k, generator=g, device="cuda")
    want = expert_ffn_reference(x, pool, slots, w, i).float()
    for cfg in [choose_config(t, k, d, i), FfnConfig(), FfnConfig(split_down=True)]:
        got = expert_ffn_triton(x, pool, slots, w, i, cfg).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 2**-6, f"{cfg}: largest difference {err:.3g} of the output's scale"
    one = expert_ffn_triton(x, pool, slots, w, i, FfnConfig())
    split = expert_ffn_triton(x, pool, slots, w, i, FfnConfig(split_down=True))
    assert torch.equal(one, split)
