"""Hybrid families (Qwen3-Next, Qwen3.5-MoE): Gated DeltaNet layers with per-sequence recurrent
state beside paged-KV full attention. Beyond the cross-family suites (families.py recipes):
prompts longer than one delta-rule chunk batched with short ones, chunked prefill carrying the
states across steps, preemption and slot reuse recomputing from token 0, prefix caching off,
the released multimodal wrapper with fused experts, the recurrences themselves against
transformers' torch forms, and the state-slot bookkeeping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moetier import LLM
from moetier.config import SchedulerConfig
from moetier.core import Request, SamplingParams
from moetier.engine.block_manager import BlockManager
from moetier.engine.scheduler import Scheduler
from moetier.engine.state_cache import LayerState, RecurrentStateCache, StateSlots
from moetier.errors import UnsupportedModelError
from moetier.layers import gated_deltanet as gdn
from tests.models.families import FAMILIES
from tests.models.parity import (
    check_parity,
    fuse_experts,
    hf_greedy,
    hf_model,
    min_budget,
    moetier_greedy,
    randomize,
)

HYBRID = ("qwen3_next", "qwen3_5_moe")
NEW = 16
# A prompt of 75 tokens spans two 64-token chunks of the delta rule; batched with short ones.
LONG = [(7 * i + 3) % 256 for i in range(75)]
MIXED = [LONG, [1, 5, 9, 33, 100, 7], [7, 8, 9], [42]]


@pytest.fixture(scope="module", params=HYBRID)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param), seed=6)


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> dict[tuple[int, ...], list[int]]:
    ref = hf_model(ckpt)
    return {tuple(p): hf_greedy(ref, p, NEW) for p in MIXED}


def _llm(path: Path, budget: Any = None, **kw: Any) -> LLM:
    return LLM(str(path), expert_budget=budget, device="cpu", dtype="float32", progress=False, **kw)


def _check(llm: LLM, want: dict[tuple[int, ...], list[int]], prompts: list[list[int]]) -> None:
    got = moetier_greedy(llm, prompts, NEW)
    for p, tokens in zip(prompts, got):
        assert tokens == want[tuple(p)], f"token mismatch for the {len(p)}-token prompt"
    llm.engine.check_integrity()
    assert not llm.engine.runner.state_cache.slots.slot_of, "a finished request kept its slot"


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_long_and_short_prompts_in_one_batch(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]], budget: str | None
) -> None:
    llm = _llm(ckpt, min_budget(ckpt) if budget == "min" else budget)
    _check(llm, reference, MIXED)
    stats = llm.offload_stats()
    assert (stats["disk_reads"] > 0) == (budget is not None)


def test_chunked_prefill_carries_the_states(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    llm = _llm(ckpt, "50%", max_num_batched_tokens=8)
    steps: list[list[tuple[int, int]]] = []
    execute = llm.engine.runner.execute

    def spy(batch: Any) -> torch.Tensor:
        steps.append([(s.request.request_id, s.num_new_tokens) for s in batch.scheduled])
        return execute(batch)

    llm.engine.runner.execute = spy  # type: ignore[method-assign]
    _check(llm, reference, MIXED)
    assert max(sum(n for _, n in step) for step in steps) <= 8
    chunks, done = [], 0  # the long prompt's (request 0) prefill chunks
    for n in (n for step in steps for rid, n in step if rid == 0):
        if done < len(LONG):
            chunks.append(n)
            done += n
    assert done == len(LONG) and len(chunks) >= 10, chunks


def test_preemption_recomputes_states_from_token_zero(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    # 12 blocks of 8 tokens: the long prompt (75 + 16) alone takes all of them, so the short
    # ones are preempted while it grows and recompute from 0 with fresh states.
    llm = _llm(ckpt, min_budget(ckpt), num_kv_blocks=12, kv_block_size=8)
    _check(llm, reference, [MIXED[1], MIXED[2], LONG, MIXED[3]])
    assert llm.engine.scheduler.num_preemptions > 0


def test_one_slot_reused_by_every_request(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    # One sequence at a time: each request gets slot 0 after the last one's states filled it.
    llm = _llm(ckpt, None, max_num_seqs=1)
    assert llm.engine.runner.state_cache.slots.num_slots == 1
    _check(llm, reference, MIXED)


def test_prefix_caching_is_off(ckpt: Path, reference: dict[tuple[int, ...], list[int]]) -> None:
    llm = _llm(ckpt, None, enable_prefix_caching=True, kv_block_size=8)
    assert not llm.engine.blocks.prefix_caching
    _check(llm, reference, [LONG])
    _check(llm, reference, [LONG])  # the same prompt again: nothing reused, same tokens
    assert llm.offload_stats()["prefix_cache_hits"] == 0


def test_prompt_logits_parity_for_a_long_prompt(ckpt: Path) -> None:
    check_parity(ckpt, "50%", prompts=[LONG, [3, 1, 4, 1, 5]])


def test_multimodal_wrapper_with_fused_experts(tmp_path: Path) -> None:
    # The released Qwen3.5 / 3.6 MoE: Qwen3_5MoeForConditionalGeneration, text settings in
    # text_config, tensors under model.language_model.*, experts fused on disk.
    from safetensors import safe_open
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    fam = FAMILIES["qwen3_5_moe"]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48)
    config = Qwen3_5MoeConfig(text_config={**fam.tiny, **fam.main}, vision_config=vision)
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(config).float()
    randomize(model)
    path = tmp_path / "wrapper"
    model.save_pretrained(path)
    fuse_experts(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" not in names
    assert check_parity(path, None)["total_experts"] == fam.routed_experts
    assert check_parity(path, min_budget(path))["disk_reads"] > 0


def test_bad_layer_types_are_refused(tmp_path: Path) -> None:
    import json

    path = FAMILIES["qwen3_next"].checkpoint(tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["linear_attention", "sliding_attention", "full_attention", "conv"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="layer_types must name one of"):
        LLM(str(path), device="cpu", dtype="float32", progress=False)


def _inputs(
    n: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 12, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, hk, dk, generator=g)
    k = torch.randn(2, n, hk, dk, generator=g)
    v = torch.randn(2, n, hv, dv, generator=g)
    decay = -torch.rand(2, n, hv, generator=g) * 2  # log decay, <= 0
    beta = torch.rand(2, n, hv, generator=g)
    state = torch.randn(2, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("n", [1, 5, 64, 130])
def test_recurrences_match_transformers_torch_forms(n: int) -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    q, k, v, decay, beta, state = _inputs(n)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_c, want_cs = ref.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, **kw)
    want_r, want_rs = ref.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, **kw)
    got_c, got_cs = gdn.chunk_gated_delta_rule(q, k, v, decay, beta, state)
    got_r, got_rs = gdn.recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    assert torch.equal(got_c, want_c) and torch.equal(got_cs, want_cs)
    assert torch.equal(got_r, want_r) and torch.equal(got_rs, want_rs)
    torch.testing.assert_close(got_c, got_r, rtol=1e-4, atol=1e-4)  # two forms, one recurrence


def test_chunked_recurrence_resumes_from_its_state() -> None:
    q, k, v, decay, beta, state = _inputs(100, seed=1)
    whole, whole_s = gdn.chunk_gated_delta_rule(q, k, v, decay, beta, state)
    a, s = gdn.chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], decay[:, :37],
                                      beta[:, :37], state)  # fmt: skip
    b, s = gdn.chunk_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], decay[:, 37:],
                                      beta[:, 37:], s)  # fmt: skip
    torch.testing.assert_close(torch.cat([a, b], dim=1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, whole_s, rtol=1e-5, atol=1e-5)
    assert (whole_s - state).abs().max() > 0.1  # the state did move


def test_cuda_kernel_dispatch_feeds_plain_heads(
    ckpt: Path, reference: dict[tuple[int, ...], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fla / causal_conv1d call path (taken on CUDA when the packages import), with
    stand-ins computing the torch forms: q/k arrive repeated to one head per value head, the
    keyword names are fla's, the conv update shifts the state it is given."""
    calls: dict[str, int] = {"chunk": 0, "recurrent": 0, "conv_update": 0}

    def fla(kind: str) -> Any:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor, output_final_state: bool,
                use_qk_l2norm_in_kernel: bool) -> Any:  # fmt: skip
            assert q.shape[2] == k.shape[2] == v.shape[2] and output_final_state
            assert use_qk_l2norm_in_kernel
            calls[kind] += 1
            form = gdn.chunk_gated_delta_rule if kind == "chunk" else gdn.recurrent_gated_delta_rule
            return form(q, k, v, g, beta, initial_state)

        return run

    def conv_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                    bias: None, activation: str) -> torch.Tensor:  # fmt: skip
        assert bias is None and activation == "silu"
        calls["conv_update"] += 1
        window = torch.cat((state, x.unsqueeze(-1)), dim=-1)  # [B, C, K]
        state.copy_(window[..., 1:])
        return torch.nn.functional.silu((window * weight).sum(-1))

    kernels = {"chunk": fla("chunk"), "recurrent": fla("recurrent"), "conv_update": conv_update}
    monkeypatch.setattr(gdn.GatedDeltaNet, "kernels", lambda self, x: kernels)
    got = moetier_greedy(_llm(ckpt, None), MIXED[1:], NEW)
    assert got == [reference[tuple(p)] for p in MIXED[1:]]
    assert all(calls.values()), calls


def test_state_slots_lowest_first_and_checked() -> None:
    slots = StateSlots(3)
    assert [slots.assign(s) for s in (10, 11, 12)] == [0, 1, 2]
    assert slots.assign(11) == 1  # idempotent
    with pytest.raises(MemoryError, match="no free slot for sequence 13"):
        slots.assign(13)
    assert slots.free(11) and not slots.free(11)
    assert slots.assign(13) == 1
    slots.check_integrity()
    slots.free_slots.append(0)  # a held slot listed free
    with pytest.raises(AssertionError, match="held state slot is free"):
        slots.check_integrity()


def test_state_save_restore_and_zero_touch_only_their_slots() -> None:
    """What a decode graph's capture relies on (engine/graphs.py): `save` copies the batch's
    states, a warm-up forward advances them, `restore` puts them back exactly; other slots are
    never touched. `zero` clears only the slots it is given."""
    cache = RecurrentStateCache(
        {0: LayerState((3, 2), (2, 2, 2)), 2: LayerState((3, 2), (2, 2, 2))}, 4,
        torch.device("cpu"), torch.bfloat16,
    )  # fmt: skip
    for layer in (0, 2):
        cache.conv(layer).copy_(torch.randn(4, 3, 2))
        cache.recurrent(layer).copy_(torch.randn(4, 2, 2, 2))
    before = [t.clone() for t in cache._pools()]
    saved = cache.save(torch.tensor([2, 0]))
    for t in cache._pools():  # the warm-up advances slots 2 and 0
        t[[0, 2]] += 1
    cache.restore(saved)
    assert all(torch.equal(a, b) for a, b in zip(cache._pools(), before))
    cache.zero([1, 3])
    for a, b in zip(cache._pools(), before):
        assert torch.equal(a[[0, 2]], b[[0, 2]]) and not a[[1, 3]].any()
    cache.zero([])  # nothing to clear: no op


def test_scheduler_takes_slots_at_admission_and_frees_them() -> None:
    slots = StateSlots(2)
    blocks = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), blocks, slots)
    reqs = [Request(i, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == [0, 1]
    assert slots.slot_of == {0: 0, 1: 1} and sched.waiting[0] is reqs[2]
    sched.check_integrity()
    sched.preempt(reqs[1])
    assert slots.slot_of == {0: 0} and reqs[1].num_computed_tokens == 0
    sched.finish(reqs[0])
    assert slots.slot_of == {}
    out = sched.schedule()  # the preempted request first, then the waiting one
    assert [s.request.request_id for s in out.scheduled] == [1, 2]
    assert slots.slot_of == {1: 0, 2: 1}
    sched.check_integrity()


def test_served_concurrent_completions_equal_transformers(tmp_path: Path) -> None:
    """`moetier serve` on a Qwen3.5-MoE checkpoint: concurrent greedy completions (batched
    in the engine) return transformers' tokens."""
    import asyncio

    import httpx

    from tests.server.conftest import start_server, stop_server
    from tests.server.tiny import VOCAB, save_byte_tokenizer

    path = FAMILIES["qwen3_5_moe"].checkpoint(tmp_path / "served", seed=8, vocab_size=VOCAB)
    save_byte_tokenizer(path)
    ref = hf_model(path)
    prompts = [LONG, MIXED[1], MIXED[2]]
    want = [hf_greedy(ref, p, NEW) for p in prompts]
    server = start_server(path, tmp_path / "server.log", "--expert-budget", "50%")

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = dict(model=server.model, prompt=prompt, max_tokens=NEW, temperature=0,
                    ignore_eos=True, return_token_ids=True)  # fmt: skip
        r = await client.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    async def run_all() -> list[list[int]]:
        async with httpx.AsyncClient() as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    try:
        assert asyncio.run(run_all()) == want
        health = server.health()  # the engine's KV, slot and state integrity checks
        assert health["num_requests_running"] == 0
    finally:
        assert stop_server(server) == 0, server.log()


def test_one_memory_budget_sets_the_state_pools_aside(ckpt: Path) -> None:
    from moetier.engine.memory_split import activation_reserve
    from moetier.engine.state_cache import state_bytes_per_slot, state_layout

    llm = _llm(ckpt, None, gpu_memory="2GiB", max_num_seqs=3, max_model_len=128)
    runner = llm.engine.runner
    cfg, sched = runner.hf_config, llm.engine.config.scheduler
    states = runner.state_cache
    per_slot = state_bytes_per_slot(state_layout(runner.model), torch.float32)
    assert states is not None and states.bytes() == 3 * per_slot > 0
    act = activation_reserve(sched.max_num_batched_tokens, 3, cfg.hidden_size, cfg.vocab_size, 4)
    assert runner.memory_split.reserve == act + states.bytes()


def test_text_config_over_wrapper_tensor_names(tmp_path: Path) -> None:
    # Qwen3_5MoeForCausalLM over tensors named as the multimodal wrapper saves them
    # (model.language_model.*), which transformers loads by dropping the prefix.
    from safetensors.torch import load_file, save_file

    path = FAMILIES["qwen3_5_moe"].checkpoint(tmp_path / "renamed", seed=9)
    fuse_experts(path)
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in renamed
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    check_parity(path, min_budget(path), prompts=MIXED[1:])
