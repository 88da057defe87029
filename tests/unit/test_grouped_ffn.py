"""kernels/grouped_ffn.py: the align puts each pair in a block of its slot (exact ids), the
reference equals a per-pair loop with skipped pairs and a running sum, and the Triton kernel
equals the reference (run by Triton's interpreter on the CPU when Triton is installed), for
every activation code (clamps hit, biases, the float32 top-k sum across waves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.kernels.expert_ffn import CLAMPED_SWIGLU, GPT_OSS_SWIGLU, expert_ffn_reference
from moetier.kernels.grouped_ffn import align, grouped_ffn_reference
from tests.unit.test_expert_ffn import _case, _run_in_interpreter, math_case


def test_align_blocks_exact() -> None:
    # 3 tokens x 2 pairs; slot 4 has three pairs, slot 1 two, one pair skipped (-1)
    slots = torch.tensor([[1, 4], [4, -1], [1, 4]])
    pairs, block_slot = align(slots, bm=2, max_experts=8)
    p = 6
    nb = -(-(p + min(p, 8) * (2 - 1)) // 2)  # the fixed bound: 6
    assert block_slot.tolist() == [1, 4, 4] + [-1] * (nb - 3)
    # slot 1: pairs 0 and 4; slot 4: pairs 1, 2, then 5 and a padding row (P)
    assert pairs.tolist()[:6] == [0, 4, 1, 2, 5, p]
    assert pairs.shape == (nb * 2,) and pairs.dtype == torch.int32


def test_align_all_skipped() -> None:
    pairs, block_slot = align(torch.full((2, 3), -1), bm=4, max_experts=2)
    assert (block_slot == -1).all() and (pairs == 6).all()


def test_reference_skips_pairs_and_continues_the_sum_fp32() -> None:
    x, pool, slots, w = _case(4, 3, 24, 10, 7, torch.float32, seed=5)
    d, i = 24, 10
    slots = slots.sort(-1).values
    skip = torch.tensor([[0, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    start = torch.randn(4, d, generator=torch.Generator().manual_seed(9))
    want = start.clone()
    for a in range(4):
        for j in range(3):
            if skip[a, j]:
                continue
            row = pool[slots[a, j]]
            gate, up = row[: i * d].view(i, d), row[i * d : 2 * i * d].view(i, d)
            down = row[2 * i * d :].view(d, i)
            want[a] += (down @ (F.silu(gate @ x[a]) * (up @ x[a]))) * w[a, j]
    got = grouped_ffn_reference(x, pool, slots.masked_fill(skip, -1), w, i, start.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_in_two_waves_equals_one_call_bf16() -> None:
    # the wave path: lower experts first, then the rest added onto the same rows, bit-equal
    x, pool, slots, w = _case(3, 4, 16, 8, 9, torch.bfloat16, seed=2)
    slots = slots.sort(-1).values
    whole = grouped_ffn_reference(x, pool, slots, w, 8)
    low = slots < 5
    out = grouped_ffn_reference(x, pool, slots.masked_fill(~low, -1), w, 8)
    grouped_ffn_reference(x, pool, slots.masked_fill(low, -1), w, 8, out)
    assert torch.equal(out, whole)


def test_reference_topk_sum_in_two_waves_equals_one_call_bf16() -> None:
    # the topk_sum wave path: a float32 running sum across waves, rounded once at the end
    for act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU):
        x, pool, slots, experts, w, math = math_case(act, 5, 4, 16, 8, 9, torch.bfloat16, seed=3)
        whole = grouped_ffn_reference(x, pool, slots, w, 8, math=math, experts=experts)
        assert torch.equal(whole, expert_ffn_reference(x, pool, slots, w, 8, None, math, experts))
        low = experts < 4
        out = torch.zeros(x.shape)  # float32
        for part in (low, ~low):
            grouped_ffn_reference(
                x, pool, slots.masked_fill(~part, -1), w, 8, out, math=math, experts=experts
            )
        assert torch.equal(out.to(torch.bfloat16), whole)


_KERNEL_CHECK = """
import torch
from moetier.kernels.expert_ffn import expert_ffn_reference, triton_available
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from moetier.kernels._grouped_ffn_triton import GroupedConfig, grouped_ffn_triton
assert triton_available()
g = torch.Generator().manual_seed(0)
for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)]:
    for t, k, d, i, s in [(1, 2, 48, 40, 6), (5, 4, 160, 72, 10), (9, 3, 130, 33, 5)]:
        x = torch.randn(t, d, generator=g).to(dtype)
        pool = (torch.randn(s, 3 * i * d, generator=g) / d**0.5).to(dtype)
        slots = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)]).sort(-1).values
        w = torch.rand(t, k, generator=g)
        want = expert_ffn_reference(x, pool, slots, w, i)
        torch.testing.assert_close(grouped_ffn(x, pool, slots, w, i, s).float(), want.float(),
                                   rtol=tol, atol=tol)
        # pairs of another wave skipped, the sum continued from `out`
        ms = torch.where(torch.rand(t, k, generator=g) < 0.5, slots, -1)
        start = torch.randn(t, d, generator=g).to(dtype)
        want = grouped_ffn_reference(x, pool, ms, w, i, start.clone())
        got = grouped_ffn(x, pool, ms, w, i, s, start.clone())
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
# every block size computes the same thing (fp32: exact up to summation order)
x = torch.randn(7, 64, generator=g)
pool = torch.randn(4, 3 * 32 * 64, generator=g) / 8
slots = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)]).sort(-1).values
w = torch.rand(7, 2, generator=g)
want = expert_ffn_reference(x, pool, slots, w, 32)
for cfg in [GroupedConfig(bm=16), GroupedConfig(bm=32, up_bn=16, up_bk=32, down_bn=32,
            down_bk=16)]:
    torch.testing.assert_close(grouped_ffn_triton(x, pool, slots, w, 32, 4, cfg=cfg), want,
                               rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_triton_grouped_kernel_matches_reference_in_interpreter() -> None:
    _run_in_interpreter(_KERNEL_CHECK)


_ACT_CHECK = """
import torch
from moetier.kernels.expert_ffn import CLAMPED_SWIGLU, GELU_TANH, GPT_OSS_SWIGLU
from moetier.kernels.grouped_ffn import grouped_ffn_reference
from moetier.kernels._grouped_ffn_triton import GroupedConfig, grouped_ffn_triton
from tests.unit.test_expert_ffn import clamp_hits, math_case
for act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU, GELU_TANH):
    for t, k, d, i, e in [(2, 4, 48, 40, 6), (9, 3, 130, 33, 8)]:
        x, pool, slots, experts, w, math = math_case(act, t, k, d, i, e, torch.float32, seed=act)
        gate, up = clamp_hits(x, pool, slots, experts, i, math)
        assert gate > 0 and up > 0, (gate, up)
        want = grouped_ffn_reference(x, pool, slots, w, i, math=math, experts=experts)
        for cfg in [GroupedConfig(bm=16), GroupedConfig(bm=32, up_bn=16, up_bk=32, down_bn=32,
                    down_bk=16)]:
            # the Triton align (binned by expert ids) and, where no bias needs the ids, the
            # PyTorch one (sorting the slots)
            for ids in [experts] + ([None] if math.biases is None else []):
                got = grouped_ffn_triton(x, pool, slots, w, i, e, cfg=cfg, experts=ids, math=math)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # two waves, the float32 running sum continued from `out`
        low = experts < e // 2
        out = torch.zeros(t, d)
        for part in (low, ~low):
            grouped_ffn_triton(x, pool, slots.masked_fill(~part, -1), w, i, e, out,
                               experts=experts, math=math)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_triton_grouped_activations_match_reference_in_interpreter() -> None:
    _run_in_interpreter(_ACT_CHECK)


_ALIGN_CHECK = """
import torch
from moetier.kernels._grouped_ffn_triton import align_triton, grouped_ffn_triton
from moetier.kernels.expert_ffn import expert_ffn_reference
from moetier.kernels.grouped_ffn import align
g = torch.Generator().manual_seed(1)
# the Triton align: the same blocks as the PyTorch one (each expert's pairs in any order)
ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(9)]).sort(-1).values
slots = (ids * 7 + 2).masked_fill(torch.rand(9, 3, generator=g) < 0.3, -1)
for bm in (2, 4):
    pairs, bslot = align_triton(ids, slots, bm, 6)
    want_pairs, want_bslot = align(slots, bm, 6)
    assert torch.equal(bslot, want_bslot), (bslot, want_bslot)
    nb = bslot.numel()
    assert pairs.shape == want_pairs.shape
    used = bslot >= 0
    for s in bslot[used].unique().tolist():  # per slot: the same pairs, in any row order
        rows = torch.cat([pairs[b * bm:(b + 1) * bm] for b in range(nb) if bslot[b] == s])
        want = torch.cat([want_pairs[b * bm:(b + 1) * bm] for b in range(nb) if want_bslot[b] == s])
        assert sorted(rows.tolist()) == sorted(want.tolist()), (s, rows, want)
# the kernel with it equals the reference
x = torch.randn(9, 40, generator=g)
pool = torch.randn(6, 3 * 24 * 40, generator=g) / 6
w = torch.rand(9, 3, generator=g)
full = ids.clone()
want = expert_ffn_reference(x, pool, full, w, 24)
got = grouped_ffn_triton(x, pool, full, w, 24, 6, experts=ids)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_triton_align_matches_torch_align_in_interpreter() -> None:
    _run_in_interpreter(_ALIGN_CHECK)


def test_terms_split_over_ranks_combine_to_the_one_call_bf16() -> None:
    # expert parallelism: each "rank" computes the terms of its experts (zero elsewhere), the
    # terms meet by bits (one writer an element), the combine equals the one-device call
    from moetier.kernels.expert_ffn import PLAIN
    from moetier.kernels.grouped_ffn import combine_terms, grouped_ffn_terms

    cases = [(PLAIN, *_case(5, 4, 16, 8, 9, torch.bfloat16, seed=4), None)]
    for act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU):
        x, pool, slots, experts, w, math = math_case(act, 5, 4, 16, 8, 9, torch.bfloat16, seed=6)
        cases.append((math, x, pool, slots, w, experts))
    for math, x, pool, slots, w, experts in cases:
        slots = slots if experts is not None else slots.sort(-1).values
        ids = experts if experts is not None else slots
        whole = grouped_ffn_reference(x, pool, slots, w, 8, math=math, experts=experts)
        bits = torch.zeros(5, 4, 16, dtype=torch.int16)
        for rank in range(3):
            mine = ids % 3 == rank
            y = grouped_ffn_terms(x, pool, slots.masked_fill(~mine, -1), w, 8, 9, experts,
                                  math=math)  # fmt: skip
            assert torch.equal(y[~mine], torch.zeros_like(y[~mine]))
            bits += y.view(torch.int16)
        assert torch.equal(combine_terms(bits.view(torch.bfloat16), math), whole)


_TERMS_CHECK = """
import torch
from moetier.kernels.grouped_ffn import combine_terms, grouped_ffn_reference
from moetier.kernels._grouped_ffn_triton import grouped_ffn_triton
from tests.unit.test_expert_ffn import _case
x, pool, slots, w = _case(6, 3, 40, 24, 7, torch.float32, seed=8)
slots = slots.sort(-1).values
skip = torch.rand(6, 3, generator=torch.Generator().manual_seed(1)) < 0.4
y = grouped_ffn_triton(x, pool, slots.masked_fill(skip, -1), w, 24, 7, terms=True)
assert y.shape == (6, 3, 40) and torch.equal(y[skip], torch.zeros_like(y[skip]))
whole = grouped_ffn_triton(x, pool, slots, w, 24, 7, terms=True)
torch.testing.assert_close(combine_terms(whole), grouped_ffn_reference(x, pool, slots, w, 24),
                           rtol=1e-5, atol=1e-5)
assert torch.equal(combine_terms(whole), grouped_ffn_triton(x, pool, slots, w, 24, 7))
print("ok")
"""


def test_triton_grouped_terms_in_interpreter() -> None:
    _run_in_interpreter(_TERMS_CHECK)
