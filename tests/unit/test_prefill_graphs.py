"""Fresh-prompt prefill graphs (engine/prefill_graphs.py) on the CPU: buckets, which steps
qualify, the padded inputs (pad tokens at the end, their K/V in the pad slot, the last real
token's index), and the padded forward through `run()` with the CUDA capture replaced by an
eager stand-in: same tokens and logits as the eager prefill, same host counters, one graph
per bucket, eager fallback for everything else. The CUDA capture itself: tests/gpu."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from moetier import LLM, SamplingParams
from moetier.bench.routing_override import OverrideGate, UniformRouting, install, uniform_ids
from moetier.core import Request
from moetier.engine.batch import ScheduledRequest, SchedulerOutput
from moetier.engine.block_manager import BlockManager
from moetier.engine.kv_cache import KV_FORMATS, LayerKV, PagedKVCache
from moetier.engine.prefill_graphs import (
    PAD_TOKEN,
    PrefillGraphs,
    _Graph,
    bucket_for,
    fresh_prompt,
    padded_inputs,
    prefill_buckets,
)
from tests.models.families import FAMILIES

# --- buckets and the step rule -------------------------------------------------------------


def test_buckets_are_powers_of_two_up_to_the_largest() -> None:
    assert prefill_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert prefill_buckets(384) == (16, 32, 64, 128, 256, 384)
    assert prefill_buckets(16) == (16,)
    assert prefill_buckets(5) == (5,)


def test_bucket_is_the_smallest_that_holds_the_prompt() -> None:
    b = prefill_buckets(512)
    got = {n: bucket_for(n, b) for n in (2, 15, 16, 17, 64, 65, 300, 512, 513)}
    assert got == {2: 16, 15: 16, 16: 16, 17: 32, 64: 64, 65: 128, 300: 512, 512: 512, 513: None}


def _sched(prompt: int, computed: int = 0, new: int | None = None, outputs: int = 0) -> Any:
    r = Request(3, list(range(1, prompt + 1)), SamplingParams(max_tokens=8))
    r.output_token_ids = list(range(100, 100 + outputs))
    r.num_computed_tokens = computed
    return ScheduledRequest(r, r.num_tokens - computed if new is None else new)


def _step(*sched: Any) -> SchedulerOutput:
    return SchedulerOutput(list(sched))


def test_only_one_fresh_whole_prompt_qualifies() -> None:
    assert fresh_prompt(_step(_sched(13))) == 13
    # preempted and recomputed from token 0 in one step: prompt and outputs, causal as a prompt
    assert fresh_prompt(_step(_sched(13, outputs=3))) == 16
    assert fresh_prompt(_step(_sched(13, computed=8))) is None  # cached prefix (or later chunk)
    assert fresh_prompt(_step(_sched(13, new=8))) is None  # first chunk of a chunked prefill
    assert fresh_prompt(_step(_sched(13, computed=13, outputs=1))) is None  # decode
    assert fresh_prompt(_step(_sched(1))) is None  # one token: a decode-shaped step
    assert fresh_prompt(_step(_sched(13), _sched(5))) is None  # two prompts
    assert fresh_prompt(_step()) is None


class _HostGate(nn.Module):
    host_routing = True  # ids from the host each call, and no way to stage them


def _block(gate: nn.Module | None = None, observer: object = None, **kw: Any) -> Any:
    return SimpleNamespace(
        gate=gate if gate is not None else nn.Linear(4, 8),
        route_observer=observer,
        slot_kernel_max_pairs=kw.get("max_pairs", 128),
        grouped_kernel=kw.get("grouped", True),
    )


def _graphs(
    blocks: list[Any], resident: bool = True, device_cache: object = None, max_tokens: int = 512
) -> PrefillGraphs:
    table = object() if resident else None
    cache = SimpleNamespace(resident_table=table, device_cache=device_cache)
    model = SimpleNamespace(moe_blocks=lambda: blocks)
    runner = SimpleNamespace(model=model, expert_cache=cache, top_k=2)
    return PrefillGraphs(runner, max_tokens)


def test_experts_must_be_resident_or_in_the_device_cache() -> None:
    step = _step(_sched(40))
    assert _graphs([_block()]).bucket(step) == 64
    assert _graphs([_block()], resident=False, device_cache=object()).bucket(step) == 64
    assert not _graphs([_block()], resident=False).qualifies(step)  # offloaded: host fetches


def test_observers_host_routers_and_kernels_decide_like_whole_decode_graphs() -> None:
    step = _step(_sched(40))  # bucket 64: 128 pairs at top-2
    assert not _graphs([_block(), _block(observer=print)]).qualifies(step)
    assert not _graphs([_block(_HostGate())]).qualifies(step)
    gate = OverrideGate(nn.Linear(4, 8, bias=False), UniformRouting(8, 2, seed=0), index=0)
    assert _graphs([_block(gate)]).qualifies(step)  # staged before each replay
    # the bucket's pairs, not the prompt's, must fit a kernel
    assert _graphs([_block(max_pairs=128, grouped=False)]).qualifies(step)
    assert not _graphs([_block(max_pairs=127, grouped=False)]).qualifies(step)
    assert not _graphs([_block(max_pairs=0, grouped=False)]).qualifies(_step(_sched(3)))


def test_prompts_above_the_largest_bucket_run_eagerly() -> None:
    graphs = _graphs([_block()], max_tokens=64)
    assert graphs.buckets == (16, 32, 64)
    assert graphs.bucket(_step(_sched(64))) == 64
    assert not graphs.qualifies(_step(_sched(65)))
    assert not graphs.qualifies(_step(_sched(40, new=20)))  # chunked
    assert not graphs.qualifies(_step(_sched(40, computed=16)))  # cached prefix


def test_switches_reach_the_engine_config() -> None:
    from moetier.bench.cli import parse_kv
    from moetier.config import EngineConfig
    from moetier.errors import ConfigError

    kw = parse_kv("prefill_graphs=false prefill_graph_max_tokens=256")  # bench --set
    assert kw == {"prefill_graphs": False, "prefill_graph_max_tokens": 256}
    cfg = EngineConfig("m", **kw)
    assert (cfg.prefill_graphs, cfg.prefill_graph_max_tokens) == (False, 256)
    assert EngineConfig("m").prefill_graphs is None  # on with cuda_graphs
    with pytest.raises(ConfigError, match="prefill_graph_max_tokens"):
        EngineConfig("m", prefill_graph_max_tokens=0)


# --- the padded inputs ---------------------------------------------------------------------


def test_padded_inputs_put_pads_last_in_the_pad_slot() -> None:
    # block size 4; the prompt's blocks 7 then 2; pad slot 40 (past 10 blocks of 4)
    flat = padded_inputs([11, 12, 13, 14, 15, 16], [7, 2], 4, 16, 40)
    assert len(flat) == 2 * 16 + 1
    ids, slots, last = flat[:16], flat[16:32], flat[32]
    assert ids == [11, 12, 13, 14, 15, 16] + [PAD_TOKEN] * 10
    assert slots == [28, 29, 30, 31, 8, 9] + [40] * 10
    assert last == 5
    full = padded_inputs(list(range(16)), [0, 1, 2, 3], 4, 16, 40)  # a prompt filling its bucket
    assert full[16:32] == list(range(16)) and full[32] == 15


def test_kv_pad_slot_is_past_the_blocks_and_outside_the_budget() -> None:
    blocks = BlockManager(3, 4)
    layout = {0: LayerKV((2, 8), (2, 8))}
    for fmt in ("fp32", "int8"):
        kv = PagedKVCache(blocks, torch.device("cpu"), layout, KV_FORMATS[fmt])
        assert kv.pad_slot == 12
        assert kv.bytes() == 12 * kv.bytes_per_token  # the budget's blocks only
        k = torch.randn(3, 2, 8)
        kv.write(0, k, k + 1, torch.tensor([0, 12, 12]))  # two pads share the slot
        got, _ = kv.read(0, torch.arange(13), torch.float32)
        assert got[1:12].abs().sum() == 0  # no block slot but the real one was written
        torch.testing.assert_close(got[0], k[0], atol=0.05, rtol=0.05)


def test_staged_override_pads_rows_after_the_real_draw() -> None:
    gate = OverrideGate(nn.Linear(4, 8, bias=False), UniformRouting(8, 2, seed=5), index=3)
    gate.stage(5, torch.device("cpu"), rows=16)
    assert gate.staged is not None and gate.staged.shape == (16, 2)
    torch.testing.assert_close(gate.staged[:5], uniform_ids(5, 3, 0, 5, 8, 2))
    assert gate.staged[5:].tolist() == [[0, 1]] * 11
    ids, _ = gate(torch.randn(16, 4))  # the graph's forward: every row
    assert ids.shape == (16, 2)
    ids, _ = gate(torch.randn(5, 4))  # a failed capture's eager run: the real rows
    torch.testing.assert_close(ids, uniform_ids(5, 3, 0, 5, 8, 2))


# --- run() with an eager stand-in for the CUDA capture --------------------------------------


class _EagerGraph:
    """A captured graph's stand-in on the CPU: replay runs the padded forward eagerly over the
    static inputs and counts nothing (a replay runs no Python)."""

    def __init__(self, graphs: PrefillGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket
        self.g: _Graph | None = None

    def replay(self) -> None:
        assert self.g is not None
        stats = self.graphs.runner.stats
        counts = stats.save_counts()
        self.g.logits.copy_(self.graphs._forward(self.g.inputs, self.bucket))
        stats.restore_counts(counts)


def _attach(llm: LLM, max_tokens: int = 512) -> tuple[PrefillGraphs, list[int]]:
    """Prefill graphs on a CPU engine, capturing with the stand-in; the buckets captured."""
    runner = llm.engine.runner
    graphs = PrefillGraphs(runner, max_tokens)
    captured: list[int] = []
    vocab = int(runner.hf_config.vocab_size)

    def capture(bucket: int, host: torch.Tensor) -> _Graph:
        stand_in = _EagerGraph(graphs, bucket)
        g = _Graph(stand_in, host.clone(), torch.empty(1, vocab))  # type: ignore[arg-type]
        stand_in.g = g
        graphs.graphs[bucket] = g
        captured.append(bucket)
        return g

    graphs._capture = capture  # type: ignore[method-assign]
    runner.prefill_graphs = graphs
    return graphs, captured


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v2", "llama4"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # deepseek_v2: MLA's latent cache, a dense first layer; llama4: chunked attention (8)
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param))


def _llm(path: Path, **kw: Any) -> LLM:
    # the grouped kernel's reference on the CPU: every MoE call takes a kernel path, as on CUDA
    return LLM(
        str(path), device="cpu", dtype="float32", progress=False, moe_grouped_kernel=True, **kw
    )


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 100, 7], [200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 17], [7] + list(range(20))]
COUNTED = ("_steps", "moe_calls", "token_lookups", "resident_lookups")


def _greedy(llm: LLM, prompt: list[int]) -> list[int]:
    return list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)


def test_padded_prefill_equals_eager_prefill(ckpt: Path) -> None:
    eager = _llm(ckpt)
    llm = _llm(ckpt)
    graphs, captured = _attach(llm)
    for prompt in PROMPTS:
        assert _greedy(llm, prompt) == _greedy(eager, prompt), prompt
        torch.testing.assert_close(
            llm.prompt_logits(prompt), eager.prompt_logits(prompt), rtol=1e-5, atol=1e-5
        )
    # lengths 6 and 12 share the 16-token graph; 21 tokens take the 32-token one
    assert captured == [16, 32] and not graphs.failed
    assert graphs.replays == 2 * len(PROMPTS)
    got, want = llm.offload_stats(), eager.offload_stats()
    assert got["prefill_graph_replays"] == graphs.replays and want["prefill_graph_replays"] == 0
    # the host counters count the prompt's tokens, as the eager step does, never the pads
    keys = [k for k in want if any(c in k for c in COUNTED)]
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    llm.engine.check_integrity()


def test_pads_write_only_the_pad_slot(tmp_path: Path) -> None:
    llm = _llm(FAMILIES["mixtral"].checkpoint(tmp_path))
    _attach(llm)
    kv = llm.engine.runner.kv_cache
    llm.prompt_logits([3, 1, 4, 1, 5])  # blocks of 16: the prompt is slots 0..4 of block 0
    assert llm.engine.runner.prefill_graphs.replays == 1
    for layer, pool in kv._k.items():
        written = pool.flatten(1).abs().sum(dim=1) != 0
        assert written.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, kv.pad_slot], layer


def test_steps_that_do_not_qualify_run_eagerly(ckpt: Path) -> None:
    eager = _llm(ckpt, enable_prefix_caching=False)
    llm = _llm(ckpt)
    graphs, captured = _attach(llm, max_tokens=32)
    long = [(7 * i + 3) % 200 for i in range(40)]
    assert _greedy(llm, long) == _greedy(eager, long)  # above the largest bucket
    # its first block (16 tokens) is now a cached prefix: the step starts past it
    cached = long[:16] + [9, 9, 9]
    assert _greedy(llm, cached) == _greedy(eager, cached)
    assert llm.engine.scheduler.prefix_cache_hits == 16
    both = PROMPTS[:2]  # two prompts in one step
    outs = [o.outputs[0].token_ids for o in llm.generate(both, GREEDY)]
    assert outs == [o.outputs[0].token_ids for o in eager.generate(both, GREEDY)]
    chunked = _llm(ckpt, max_num_batched_tokens=8)  # the 12-token prompt in two chunks
    chunked_graphs, _ = _attach(chunked)
    assert _greedy(chunked, PROMPTS[1]) == _greedy(eager, PROMPTS[1])
    assert graphs.replays == chunked_graphs.replays == 0
    graphs.failed.add(16)  # a failed capture: its bucket stays eager
    assert _greedy(llm, PROMPTS[0]) == _greedy(eager, PROMPTS[0])
    assert graphs.replays == 0 and captured == []
    graphs.failed.clear()
    assert _greedy(llm, PROMPTS[0]) == _greedy(eager, PROMPTS[0])
    assert graphs.replays == 1 and captured == [16]


def test_routing_override_is_staged_with_pad_rows(ckpt: Path) -> None:
    def run(llm: LLM) -> list[list[int]]:
        runner = llm.engine.runner
        install(runner.model.moe_blocks(), UniformRouting(runner.num_experts, runner.top_k, 1))
        return [_greedy(llm, p) for p in PROMPTS]

    llm = _llm(ckpt)
    graphs, _ = _attach(llm)
    _greedy(llm, PROMPTS[0])  # a graph with the model's own routers first: dropped on install
    assert run(llm) == run(_llm(ckpt))
    assert graphs.replays == 1 + len(PROMPTS) and graphs.staged
