"""DeepSeek-V4 beyond the cross-family suites (families.py recipe): a long prompt (many CSA and
HCA windows, the indexer choosing among them) batched with short ones at every expert budget,
chunked prefill splitting windows across steps, preemption recomputing from token 0, prefix
caching on (the cached rows rebuild the same compressed entries), hash-routed layers using
exactly `tid2eid[token]`, bfloat16 (transformers keeps norms, mHC weights, sinks and gate biases
in float32; so do we), the per-token KV row of each attention kind, and the routed experts'
clamped SwiGLU on the expert kernels (a recipe whose limit clamps a good share of the entries):
slot and grouped kernels, the device cache, and the kernels' math bit-equal to the loop in
bfloat16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetier import LLM
from moetier.engine.kv_cache import kv_layout
from moetier.errors import UnsupportedModelError
from moetier.kernels.expert_ffn import ExpertMath, expert_ffn_reference
from moetier.models.deepseek_v4 import V4MoE, check_config
from tests.models.families import FAMILIES
from tests.models.parity import (
    PROMPTS,
    check_grouped_kernel_in_interpreter,
    check_parity,
    hf_greedy,
    hf_last_logits,
    hf_model,
    min_budget,
    moetier_greedy,
)
from tests.unit.test_expert_ffn import loop_output, selection_case

V4 = FAMILIES["deepseek_v4"]
NEW = 16
# 75 tokens: 18 CSA windows (rate 4, the indexer keeps 2 per query) and 9 HCA windows (rate 8)
LONG = [(7 * i + 3) % 256 for i in range(75)]
MIXED = [LONG, [1, 5, 9, 33, 100, 7], [7, 8, 9], [42]]
# shares LONG's first 64 tokens, then differs: a prefix-cache hit with another suffix
FORK = LONG[:64] + [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return V4.checkpoint(tmp_path_factory.mktemp("deepseek_v4"), seed=6)


@pytest.fixture(scope="module")
def clamped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe with swiglu_limit 1 (10 in the released config, which these tiny experts
    never reach): about a sixth of the routed experts' gate and a third of their up entries
    clamp."""
    return V4.checkpoint(tmp_path_factory.mktemp("deepseek_v4_clamped"), seed=3, swiglu_limit=1.0)


# the slot kernel for every step, or the grouped one (both their references on the CPU)
KERNELS: dict[str, dict[str, Any]] = {
    "slot": dict(moe_slot_kernel_max_pairs=1 << 20),
    "grouped": dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=0),
}


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> dict[tuple[int, ...], list[int]]:
    ref = hf_model(ckpt)
    return {tuple(p): hf_greedy(ref, p, NEW) for p in [*MIXED, FORK]}


def _llm(path: Path, budget: Any = None, **kw: Any) -> LLM:
    return LLM(str(path), expert_budget=budget, device="cpu", dtype="float32", progress=False, **kw)


def _check(llm: LLM, want: dict[tuple[int, ...], list[int]], prompts: list[list[int]]) -> None:
    got = moetier_greedy(llm, prompts, NEW)
    for p, tokens in zip(prompts, got):
        assert tokens == want[tuple(p)], f"token mismatch for the {len(p)}-token prompt"
    llm.engine.check_integrity()


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_long_and_short_prompts_in_one_batch(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]], budget: str | None
) -> None:
    llm = _llm(ckpt, min_budget(ckpt) if budget == "min" else budget)
    _check(llm, reference, MIXED)
    stats = llm.offload_stats()
    assert stats["total_experts"] == V4.routed_experts
    assert (stats["disk_reads"] > 0) == (budget is not None)


def test_chunked_prefill_splits_windows_across_steps(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    # chunks of at most 7 tokens: window boundaries (every 4 and 8) fall inside chunks
    llm = _llm(ckpt, "50%", max_num_batched_tokens=7)
    steps: list[list[tuple[int, int]]] = []
    execute = llm.engine.runner.execute

    def spy(batch: Any) -> torch.Tensor:
        steps.append([(s.request.request_id, s.num_new_tokens) for s in batch.scheduled])
        return execute(batch)

    llm.engine.runner.execute = spy  # type: ignore[method-assign]
    _check(llm, reference, MIXED)
    assert max(sum(n for _, n in step) for step in steps) <= 7
    chunks, done = [], 0  # the long prompt's (request 0) prefill chunks
    for n in (n for step in steps for rid, n in step if rid == 0):
        if done < len(LONG):
            chunks.append(n)
            done += n
    assert done == len(LONG) and len(chunks) >= 11, chunks


def test_preemption_recomputes_from_token_zero(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    # 12 blocks of 8 tokens: the long prompt (75 + 16) alone takes all of them, so the short
    # ones are preempted while it grows and recompute from 0.
    llm = _llm(ckpt, min_budget(ckpt), num_kv_blocks=12, kv_block_size=8)
    _check(llm, reference, [MIXED[1], MIXED[2], LONG, MIXED[3]])
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_caching_reuses_rows_exactly(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    llm = _llm(ckpt, None, enable_prefix_caching=True, kv_block_size=8)
    assert llm.engine.blocks.prefix_caching
    _check(llm, reference, [LONG])
    _check(llm, reference, [FORK])  # 64 cached tokens: 16 CSA and 8 HCA windows rebuilt
    _check(llm, reference, [LONG])
    assert llm.engine.scheduler.prefix_cache_hits >= 64 + 72


def test_hash_layers_route_by_token_id(ckpt: Path) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    llm = _llm(ckpt, "50%")
    seen: dict[int, list[list[int]]] = {}
    blocks = llm.engine.runner.model.moe_blocks()
    for b in blocks:
        b.route_observer = lambda layer, ids, k: seen.setdefault(layer, []).append(ids)
    prompt = MIXED[1]
    moetier_greedy(llm, [prompt], 2)
    tables = [tensors[f"model.layers.{i}.ffn.gate.tid2eid"] for i in (0, 1)]
    assert tables[0].any() and not torch.equal(tables[0], tables[1])
    for layer, kind in enumerate(V4.main["mlp_layer_types"]):
        table = tables[layer] if kind == "hash_moe" else tables[0]
        want = table[torch.tensor(prompt)].flatten().tolist()  # the prefill's ids, token-major
        # hash layers: exactly the table's experts; learned layers: their own choice
        assert (seen[layer][0] == want) == (kind == "hash_moe")


def test_kv_row_per_attention_kind(ckpt: Path) -> None:
    """Sliding: the key (d); HCA: + kv and gate (2d); CSA: + both series (4d) and the
    indexer's (4 dI): one shared head per token."""
    d, di = V4.tiny["head_dim"], V4.tiny["index_head_dim"]
    layout = kv_layout(_llm(ckpt).engine.runner.model)
    widths = {layer: spec.k for layer, spec in layout.items()}
    assert widths == {0: (1, d), 1: (1, 5 * d + 4 * di), 2: (1, 3 * d), 3: (1, 5 * d + 4 * di)}
    assert all(spec.v is None for spec in layout.values())


def test_gate_lookahead_prefetch_skips_hash_layers(ckpt: Path) -> None:
    """The next layer's router on this layer's hidden state: a hash router cannot route one
    (it needs token ids), so hash layers get no guess (their exact prefetch is below); learned
    ones do."""
    expert = 3 * V4.tiny["hidden_size"] * V4.tiny["moe_intermediate_size"] * 4
    three_waves = f"{3 * V4.tiny['num_experts_per_tok'] * expert}B"
    stats = check_parity(ckpt, three_waves, prefetch="gate-lookahead")
    assert stats["prefetches_issued"] > 0 and stats["disk_reads"] > 0


def _count_fetches(llm: LLM) -> tuple[dict[int, int], list[tuple[int, list[int]]]]:
    """Spy on the expert cache: on-demand misses per MoE layer (each fetch's lookups less its
    device hits; a prefetched key is a device hit) and every fetch's (layer, experts)."""
    cache = llm.engine.runner.expert_cache
    stats, fetch = cache.stats, cache.fetch
    misses: dict[int, int] = {}
    fetches: list[tuple[int, list[int]]] = []

    def spy(layer: int, experts: list[int], routing: Any = None) -> Any:
        requests, hits = stats.requests, stats.device_hits
        batch = fetch(layer, experts, routing)
        missed = (stats.requests - requests) - (stats.device_hits - hits)
        misses[layer] = misses.get(layer, 0) + missed
        fetches.append((layer, list(experts)))
        return batch

    cache.fetch = spy  # type: ignore[method-assign]
    return misses, fetches


def _lru_misses(fetches: list[tuple[int, list[int]]], slots: int) -> dict[int, int]:
    """Misses per layer of an LRU pool of `slots` keys serving `fetches` in order (a fetch's
    own keys are never its victims): the expert cache without prefetch."""
    lru: list[tuple[int, int]] = []  # least recently used first
    misses: dict[int, int] = {}
    for layer, experts in fetches:
        keys = [(layer, e) for e in experts]
        for key in keys:
            if key in lru:
                lru.remove(key)
            else:
                misses[layer] = misses.get(layer, 0) + 1
                if len(lru) == slots:
                    lru.remove(next(k for k in lru if k not in keys))
            lru.append(key)
    return misses


@pytest.mark.parametrize("predictor", ["hash", "last-call"])
def test_hash_layers_prefetch_exactly_their_tables_experts(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]], predictor: str
) -> None:
    """Each step, before layer 0 runs, its experts `tid2eid_0[step's tokens]`; at layer 0's
    call layer 1's `tid2eid_1[...]`: distinct, ascending, nothing else for a hash layer (no
    guess from `last-call`, which guesses for the learned layers)."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    tables = {i: tensors[f"model.layers.{i}.ffn.gate.tid2eid"] for i in (0, 1)}
    llm = _llm(ckpt, "50%", prefetch=predictor)
    cache = llm.engine.runner.expert_cache
    calls: list[tuple[int, list[int]]] = []
    prefetch = cache.prefetch

    def spy(layer: int, experts: Any) -> int:
        calls.append((layer, list(experts)))
        return prefetch(layer, experts)

    cache.prefetch = spy  # type: ignore[method-assign]
    prompt = MIXED[1]
    out = moetier_greedy(llm, [prompt], 4)[0]
    assert out == reference[tuple(prompt)][:4]
    steps = [prompt, *([t] for t in out[:3])]  # the prefill, then one decode per new token
    want = [
        (layer, sorted(set(table[torch.tensor(ids)].flatten().tolist())))
        for ids in steps
        for layer, table in tables.items()
    ]
    assert want[:2] == [(0, [0, 2, 3, 4, 5, 7]), (1, [0, 2, 3, 4, 6, 7])]  # the prefill's
    assert [c for c in calls if c[0] in tables] == want
    assert any(c[0] not in tables for c in calls) == (predictor == "last-call")


def test_prefetched_hash_experts_are_hits_at_the_minimum_budget(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """Two slots (top-2): without prefetch every call misses both experts, 16 steps x 2 per
    layer. With it, each step's layer-0 experts are loaded into the two slots the last layer
    left unpinned before layer 0 runs (32 prefetches, all used: layer 0 never misses); layer
    1's prefetch, issued during layer 0's call, finds both slots pinned and starts nothing."""
    runs = {}
    for name in (None, "hash"):
        llm = _llm(ckpt, min_budget(ckpt), prefetch=name)
        misses, _ = _count_fetches(llm)
        _check(llm, reference, [[42]])
        runs[name] = misses, llm.offload_stats()
    (off, off_stats), (on, on_stats) = runs[None], runs["hash"]
    assert off == {0: 32, 1: 32, 2: 32, 3: 32}
    assert on == {0: 0, 1: 32, 2: 32, 3: 32}
    assert (on_stats["prefetches_issued"], on_stats["prefetches_used"]) == (32, 32)
    assert (off_stats["device_hits"], on_stats["device_hits"]) == (0, 32)
    assert off_stats["disk_reads"] == on_stats["disk_reads"] == 128  # moved earlier, not more


@pytest.mark.parametrize("host_budget", [None, "75%"])
def test_prefetched_hash_experts_are_hits_at_half_budget(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]], host_budget: str | None
) -> None:
    """16 slots: without prefetch the hash layers miss exactly what an LRU pool of 16 keys
    misses on the run's fetches; with it they never miss (every prefetch used, each miss now a
    device hit), and the learned layers miss as often as before. With a host tier (24 rows)
    the misses the prefetch took away were partly host hits: fewer of those too."""
    runs = {}
    for name in (None, "hash"):
        llm = _llm(ckpt, "50%", prefetch=name, host_budget=host_budget)
        misses, fetches = _count_fetches(llm)
        _check(llm, reference, [[42]])
        runs[name] = misses, fetches, llm.offload_stats()
    slots = llm.engine.runner.expert_cache.num_slots
    (off, fetches, off_stats), (on, _, on_stats) = runs[None], runs["hash"]
    assert slots == 16 and off == _lru_misses(fetches, slots) == {0: 13, 1: 12, 2: 10, 3: 10}
    assert on == {0: 0, 1: 0, 2: 10, 3: 10}
    assert on_stats["prefetches_issued"] == on_stats["prefetches_used"] == 26
    assert on_stats["device_hits"] == off_stats["device_hits"] + 13 + 12 == 108
    if host_budget is not None:
        assert (off_stats["host_hits"], on_stats["host_hits"]) == (14, 5)


@pytest.mark.parametrize("budget", ["50%", "min"])
def test_hash_prefetch_keeps_tokens_and_logits(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]], budget: str
) -> None:
    """Long and short prompts batched: greedy tokens with the exact prefetch on equal those
    with it off and transformers', the logits are bit for bit the same, and every exact
    prefetch is used (ascending order: the first wave's experts when slots run out)."""
    size = min_budget(ckpt) if budget == "min" else budget
    off, on = _llm(ckpt, size), _llm(ckpt, size, prefetch="hash")
    got = [moetier_greedy(llm, MIXED, NEW) for llm in (off, on)]
    assert got[0] == got[1] == [reference[tuple(p)] for p in MIXED]
    assert torch.equal(off.prompt_logits(LONG), on.prompt_logits(LONG))
    stats = on.offload_stats()
    assert stats["prefetches_issued"] == stats["prefetches_used"] > 0
    on.engine.check_integrity()


def test_quantized_checkpoints_are_refused(ckpt: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt)
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(UnsupportedModelError, match="quantization_config"):
        check_config(config)


@pytest.mark.parametrize("kernel", [None, "slot"])
def test_parity_in_bfloat16(tmp_path: Path, kernel: str | None) -> None:
    """The recipe stored and computed in bfloat16, by the per-expert loop or the slot kernel's
    path: the same tokens, logits within 1e-2 (they come out equal: the float32 sinks promote
    each softmax row to float32 as in HF)."""
    path = V4.checkpoint(tmp_path / "bf16", seed=6)
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_model(path, torch.bfloat16)
    kw = KERNELS[kernel] if kernel else {}
    llm = LLM(str(path), expert_budget="50%", device="cpu", dtype="bfloat16", progress=False, **kw)
    for prompt, tokens in zip(MIXED, moetier_greedy(llm, MIXED, NEW)):
        assert tokens == hf_greedy(ref, prompt, NEW), f"token mismatch for {len(prompt)} tokens"
        torch.testing.assert_close(
            llm.prompt_logits(prompt), hf_last_logits(ref, prompt), rtol=1e-2, atol=1e-2
        )


def test_clamp_changes_transformers_tokens(clamped: Path, tmp_path: Path) -> None:
    # the clamped recipe means something only if the clamp moves transformers' own tokens
    unclamped = V4.checkpoint(tmp_path / "unclamped", seed=3)
    want = [hf_greedy(hf_model(clamped), p) for p in PROMPTS]
    assert [hf_greedy(hf_model(unclamped), p) for p in PROMPTS] != want


@pytest.mark.parametrize("budget", [None, "min"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_clamped_experts_on_the_kernels(clamped: Path, kernel: str, budget: str | None) -> None:
    stats = check_parity(clamped, min_budget(clamped) if budget else None, **KERNELS[kernel])
    if budget is None:  # every call through the kernel path's device table
        assert stats["resident_lookups"] > 0 and stats["requests"] == 0


def test_clamped_experts_on_the_triton_kernel_in_interpreter(clamped: Path) -> None:
    # the kernel itself, not its reference: transformers' tokens through the clamps
    check_grouped_kernel_in_interpreter(clamped)


def test_device_cache_parity(clamped: Path) -> None:
    """The device cache (every MoE call resolved by tensor ops for the kernels) at a budget
    that evicts: eager steps only (CUDA graphs are off for V4: Family.no_graphs)."""
    stats = check_parity(
        clamped, "50%", host_budget="100%", device_cache=True, **KERNELS["grouped"]
    )
    assert stats["host_hits"] > 0 and stats["evictions"] > 0
    assert stats["moe_calls_host_decode"] == 0


def test_kernel_math_equals_the_loop_bitwise_bf16() -> None:
    """The kernels' reference (ExpertMath CLAMPED_SWIGLU, the float32 top-k sum) computes
    V4MoE.expert_mlp's loop with the same roundings: bit-equal in bfloat16 on experts whose dot
    products are exact, with clamps hit (an unclamped or per-add-rounded sum differs)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v4", **{**V4.tiny, **V4.main}, swiglu_limit=1.0)
    block = V4MoE(config, 2, hashed=False).to(torch.bfloat16)
    # top-4 (the recipe routes 2): with two terms a per-add rounding equals one rounding
    x, gate_up, down, pool, experts, w = selection_case(24, 4, 64, 32, 8, torch.bfloat16, 2.0)
    want = loop_output(block, x, gate_up, down, experts, w)
    math = block.expert_math()
    got = expert_ffn_reference(x, pool, experts, w, 32, None, math, experts)
    assert torch.equal(got, want)
    for other in (ExpertMath(math.act, 100.0, topk_sum=True), ExpertMath(math.act, 1.0)):
        assert not torch.equal(expert_ffn_reference(x, pool, experts, w, 32, None, other), want)
