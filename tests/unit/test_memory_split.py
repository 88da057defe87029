"""One device-memory budget (`gpu_memory`) split between expert slots and KV blocks: exact slot
and block counts on a tiny checkpoint, the errors of a split that cannot fit, explicit
overrides, and the trace objective's choice among its candidates (engine/memory_split.py).

Expected numbers come from the rule as the README states it, written out here: sizes from the
checkpoint's headers and its config, hit rates from the existing replay (bench/replay.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from moetier import LLM
from moetier.bench.belady import belady
from moetier.bench.replay import load_trace, simulate
from moetier.cli import build_parser, main
from moetier.engine.memory_split import SplitRequest, choose_split, trace_curve
from moetier.errors import BudgetError, ConfigError
from moetier.metrics import ServerMetrics
from moetier.offload.policy import make_policy
from moetier.server.cli import _engine_args
from moetier.weights.checkpoint import Checkpoint
from tests.models.families import FAMILIES

# The mixtral tiny shape (tests/models/families.py) in float32 on the CPU.
LAYERS, EXPERTS, TOP_K, HIDDEN, INTER, KV_HEADS, HEAD_DIM, VOCAB = 3, 8, 2, 64, 96, 2, 16, 256
EXPERT_BYTES = 3 * HIDDEN * INTER * 4  # w1, w3, w2
TOTAL = LAYERS * EXPERTS
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V, fp32
BLOCK = 16
BLOCK_BYTES = BLOCK * TOKEN_BYTES
BATCHED = 512  # max_num_batched_tokens in every engine here


def reserve(max_num_seqs: int) -> int:
    """1 GiB + a step's activations + the logits (README, "One memory budget")."""
    return (1 << 30) + BATCHED * 16 * HIDDEN * 4 + max_num_seqs * VOCAB * 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["mixtral"].checkpoint(tmp_path_factory.mktemp("split") / "mixtral")


@pytest.fixture(scope="module")
def weights(ckpt: Path) -> int:
    """Non-expert bytes from the checkpoint's headers (float32 as stored)."""
    c = Checkpoint(ckpt)
    try:
        infos = list(c.tensors.values())
    finally:
        c.close()
    assert sum(t.nbytes for t in infos if ".experts." in t.name) == TOTAL * EXPERT_BYTES
    return sum(t.nbytes for t in infos if ".experts." not in t.name)


def _llm(ckpt: Path, **kw: Any) -> LLM:
    return LLM(
        str(ckpt),
        device="cpu",
        dtype="float32",
        progress=False,
        max_num_batched_tokens=BATCHED,
        **kw,
    )


def _split(llm: LLM) -> tuple[int, int, str]:
    s = llm.offload_stats()
    assert s["split_expert_bytes"] == s["device_slots"] * EXPERT_BYTES
    assert s["split_kv_bytes"] == s["kv_blocks_total"] * BLOCK_BYTES == s["kv_cache_bytes"]
    return int(s["device_slots"]), int(s["kv_blocks_total"]), str(s["split_reason"])


def test_kv_request_then_experts_then_whole_blocks(ckpt: Path, weights: int) -> None:
    # max_num_seqs 2 x max_model_len 64 = 8 blocks asked; 10 slots and 3 more blocks fit
    # beside them, plus 5000 B that buy neither
    gpu = weights + reserve(2) + 10 * EXPERT_BYTES + (8 + 3) * BLOCK_BYTES + 5000
    llm = _llm(ckpt, gpu_memory=gpu, max_num_seqs=2, max_model_len=64)
    assert _split(llm) == (10, 11, "kv_request")
    s = llm.offload_stats()
    assert s["gpu_memory_bytes"] == gpu and s["kv_bytes_per_token"] == TOKEN_BYTES
    assert len(llm.generate([[1, 2, 3]])[0].outputs[0].token_ids) == 16
    stats = llm.engine.stats()
    assert (stats["gpu_memory_bytes"], stats["split_expert_bytes"]) == (gpu, 10 * EXPERT_BYTES)
    assert "split_reason" not in stats  # a name, not a number: memory_split_info carries it


def test_every_expert_resident_rest_to_kv(ckpt: Path, weights: int) -> None:
    gpu = weights + reserve(1) + TOTAL * EXPERT_BYTES + 40 * BLOCK_BYTES
    llm = _llm(ckpt, gpu_memory=gpu, max_num_seqs=1, max_model_len=64)
    assert _split(llm) == (TOTAL, 40, "kv_request")


def test_impossible_split_names_the_numbers(ckpt: Path, weights: int) -> None:
    # top-k slots + 4 x 256 tokens (64 blocks) is the minimum; one byte less cannot start
    need = TOP_K * EXPERT_BYTES + 4 * 16 * BLOCK_BYTES
    gpu = weights + reserve(4) + need - 1
    with pytest.raises(BudgetError) as info:
        _llm(ckpt, gpu_memory=gpu, max_num_seqs=4)
    msg = str(info.value)
    for part in (
        f"({gpu} B) cannot hold top-k = 2 expert slots of {EXPERT_BYTES} B",
        "KV for 4 x 256 tokens",
        f"64 blocks of 16 tokens at {TOKEN_BYTES} B/token as fp32",
        f"non-expert weights ({weights} B)",
        f"reserve ({reserve(4)} B)",
        f"{need - 1} B are left, {need} B are needed",
        "lower --max-num-seqs (now 4)",
        "lower --max-model-len (now 256)",
        "--kv-cache-dtype int8",
        "raise --gpu-memory",
    ):
        assert part in msg, msg
    assert _split(_llm(ckpt, gpu_memory=gpu + 1, max_num_seqs=4)) == (2, 64, "kv_request")


def test_below_weights_and_reserve(ckpt: Path, weights: int) -> None:
    with pytest.raises(BudgetError, match=f"below the non-expert weights \\({weights} B\\)"):
        _llm(ckpt, gpu_memory="1GiB")


def test_explicit_expert_budget_kv_gets_the_rest(ckpt: Path, weights: int) -> None:
    gpu = weights + reserve(64) + 6 * EXPERT_BYTES + 20 * BLOCK_BYTES + 100
    llm = _llm(ckpt, gpu_memory=gpu, expert_budget="25%", max_model_len=64)
    assert _split(llm) == (6, 20, "expert_budget")  # 25% of 24 experts


def test_explicit_kv_blocks_experts_get_the_rest(ckpt: Path, weights: int) -> None:
    gpu = weights + reserve(64) + 7 * EXPERT_BYTES + 10 * BLOCK_BYTES + 100
    llm = _llm(ckpt, gpu_memory=gpu, num_kv_blocks=10)
    assert _split(llm) == (7, 10, "num_kv_blocks")


def test_both_explicit_beyond_gpu_memory_is_an_error(ckpt: Path, weights: int) -> None:
    need = 6 * EXPERT_BYTES + 10 * BLOCK_BYTES
    gpu = weights + reserve(64) + need - 1
    with pytest.raises(BudgetError, match=f"6 expert slots and 10 KV blocks: .* {need} B are need"):
        _llm(ckpt, gpu_memory=gpu, expert_budget="25%", num_kv_blocks=10)


def _req(remainder: int, max_num_seqs: int = 64, seqs_fixed: bool = False) -> SplitRequest:
    """The tiny shape at max_model_len 256 (16 blocks a sequence), weights and reserve 0."""
    return SplitRequest(
        remainder, 0, 0, EXPERT_BYTES, TOTAL, TOP_K, LAYERS, EXPERTS, BLOCK_BYTES, BLOCK,
        TOKEN_BYTES, "fp32", 256, max_num_seqs, seqs_fixed,
    )  # fmt: skip


def distinct(seqs: int) -> float:
    """D(b): distinct experts a MoE layer needs in a step of b independent sequences."""
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** seqs)


def tokens_per_s(seqs: int, hit: float) -> float:
    """The objective as the README writes it."""
    return seqs / (LAYERS * distinct(seqs) * EXPERT_BYTES * ((1 - hit) / 53e9 + 1 / 4e12))


def replayed(seqs: int, slots: int) -> int:
    """The pool one sequence's share of `slots` is replayed at: S x k / D(b), all resident kept."""
    return slots if slots >= TOTAL else max(1, int(slots * TOP_K / distinct(seqs)))


# every expert resident at one sequence: 2, 4 and 8 sequences leave 21, 16 and 5 slots
REMAINDER = TOTAL * EXPERT_BYTES + 16 * BLOCK_BYTES
CANDIDATES = [(1, 24, 16), (2, 21, 34), (4, 16, 64), (8, 5, 130)]  # (seqs, slots, KV blocks)


def test_hand_made_curve_picks_the_objective_maximum() -> None:
    asked: list[list[int]] = []
    hits = {24: 1.0, 12: 0.999, 7: 0.99, 5: 0.9, 1: 0.0}  # by replayed slots

    def curve(slots: list[int]) -> dict[int, tuple[float, float]]:
        asked.append(slots)
        return {s: (hits[s], min(1.0, hits[s] + 0.001)) for s in slots}

    slots, blocks, reason, points = choose_split(_req(REMAINDER), curve=curve)
    assert [replayed(b, s) for b, s, _ in CANDIDATES] == [24, 12, 5, 1]
    assert asked == [[24, 12, 5, 1]]
    assert [(p.seqs, p.slots, p.kv_blocks, p.replayed_slots) for p in points] == [
        (*c, r) for c, r in zip(CANDIDATES, [24, 12, 5, 1])
    ]
    expected = [tokens_per_s(b, hits[replayed(b, s)]) for b, s, _ in CANDIDATES]
    assert [p.tokens_per_s for p in points] == pytest.approx(expected, rel=1e-12)
    assert expected[1] > expected[0] > max(expected[2:])  # 2 sequences at 99.9% beat 1 at 100%
    assert (slots, blocks, reason) == (21, 34, "trace")
    # max_num_seqs 3: candidates 1, 2 and 3 sequences; set by the user, the curve is not asked
    _, _, _, few = choose_split(_req(REMAINDER, max_num_seqs=3), curve=curve)
    assert [(p.seqs, p.slots, p.kv_blocks, p.replayed_slots) for p in few] == [
        (1, 24, 16, 24),
        (2, 21, 34, 12),
        (3, 18, 52, 7),
    ]
    fixed = choose_split(_req(REMAINDER, max_num_seqs=3, seqs_fixed=True), curve=curve)
    assert fixed == (18, 52, "kv_request", ()) and len(asked) == 2


def _write_trace(path: Path, steps: int) -> None:
    """Batch-1 decode: each MoE layer picks 2 of its first 4 experts (12 keys in all)."""
    rng = random.Random(0)
    head = {
        "format": "moetier-trace",
        "version": 1,
        "num_layers": LAYERS,
        "num_experts": EXPERTS,
        "top_k": TOP_K,
        "moe_layers": [0, 1, 2],
        "expert_bytes": 0,
    }
    lines = [json.dumps(head)]
    for step in range(steps):
        for layer in range(LAYERS):
            experts = rng.sample(range(4), 2)
            lines.append(json.dumps({"step": step, "layer": layer, "requests": [0],
                                     "experts": [experts]}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_trace_split_is_the_objectives_choice(
    ckpt: Path, weights: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "trace.jsonl"
    _write_trace(path, 3000)
    trace = load_trace(path)
    curve = []
    for seqs, slots, blocks in CANDIDATES:
        share = replayed(seqs, slots)
        initial = (
            [(la, e) for la in range(LAYERS) for e in range(EXPERTS)] if share >= TOTAL else []
        )
        hit = simulate(trace.records, share, make_policy("lru"), initial).hit_rate
        best = belady(trace.records, share, initial=initial).hit_rate
        curve.append((seqs, slots, blocks, share, hit, best, tokens_per_s(seqs, hit)))
    chosen = max(curve, key=lambda c: (c[6], c[0]))
    # the 12 keys fit in the 12 slots 2 sequences replay at: only first loads miss
    assert chosen[:4] == (2, 21, 34, 12)
    gpu = weights + reserve(64) + REMAINDER
    with caplog.at_level("INFO", logger="moetier.engine.memory_split"):
        llm = _llm(ckpt, gpu_memory=gpu, routing_trace=path)
    assert _split(llm) == (21, 34, "trace")
    points = llm.engine.runner.memory_split.curve
    assert [
        (p.seqs, p.slots, p.kv_blocks, p.replayed_slots, p.hit_rate, p.belady) for p in points
    ] == [c[:6] for c in curve]
    assert [p.tokens_per_s for p in points] == pytest.approx([c[6] for c in curve], rel=1e-12)
    logged = [r.getMessage() for r in caplog.records]
    assert sum("memory split candidate" in m for m in logged) == 4, logged
    assert any(
        "21 expert slots, 34 KV blocks: replayed at 12" in m and "(chosen)" in m for m in logged
    )
    assert any(m.startswith("memory split (trace)") for m in logged), logged
    # an explicit max_num_seqs fixes the KV request: the trace is not consulted for the split
    fixed = _llm(ckpt, gpu_memory=weights + reserve(2) + REMAINDER, routing_trace=path,
                 max_num_seqs=2)  # fmt: skip
    assert _split(fixed) == (21, 34, "kv_request")


def test_trace_of_another_shape_and_trace_without_budget(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write_trace(path, 2)
    with pytest.raises(ConfigError, match="3 MoE layers x 8 experts, top-2; this model has 3 x 16"):
        trace_curve(str(path), "lru", 16, TOP_K, LAYERS)
    with pytest.raises(ConfigError, match="set gpu_memory too"):
        LLM(str(tmp_path / "missing"), device="cpu", routing_trace=path)
    with pytest.raises(ConfigError, match="no such file"):
        LLM(str(tmp_path / "missing"), device="cpu", gpu_memory="2GiB", routing_trace="nope")


def test_generate_sizes_the_kv_for_its_one_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_llm(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr("moetier.LLM", fake_llm)
    assert main(["generate", "--gpu-memory", "24GiB"]) == 2
    assert (seen["gpu_memory"], seen["max_num_seqs"]) == ("24GiB", 1)


def test_flags_reach_the_engine() -> None:
    p = build_parser()
    assert p.parse_args(["generate", "--gpu-memory", "90%"]).gpu_memory == "90%"
    args = _engine_args(p.parse_args(["serve", "--gpu-memory", "24GiB", "--routing-trace", "t"]))
    assert (args.gpu_memory, args.routing_trace, args.max_num_seqs) == ("24GiB", "t", None)
    assert _engine_args(p.parse_args(["serve", "--max-num-seqs", "8"])).max_num_seqs == 8


def test_metrics_export_the_split() -> None:
    metrics = ServerMetrics("m", split_reason="trace")
    metrics.update_engine(
        {"gpu_memory_bytes": 7.0, "split_expert_bytes": 5.0, "split_kv_bytes": 2.0}
    )
    text = prometheus_client.generate_latest(metrics.registry).decode()
    for line in (
        'moetier:gpu_memory_bytes{model_name="m"} 7.0',
        'moetier:memory_split_expert_bytes{model_name="m"} 5.0',
        'moetier:memory_split_kv_bytes{model_name="m"} 2.0',
        'moetier:memory_split_info{model_name="m",split_reason="trace"} 1.0',
    ):
        assert line in text, text


def test_share_of_the_device(ckpt: Path, weights: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = weights + reserve(1) + TOTAL * EXPERT_BYTES + 20 * BLOCK_BYTES
    monkeypatch.setattr("moetier.engine.memory_split.device_total", lambda device: 4 * gpu)
    llm = _llm(ckpt, gpu_memory="25%", max_num_seqs=1)
    assert _split(llm) == (TOTAL, 20, "kv_request")
    assert llm.offload_stats()["gpu_memory_bytes"] == gpu
    with pytest.raises(ConfigError, match="more than the"):
        _llm(ckpt, gpu_memory=4 * gpu + 1, max_num_seqs=1)
