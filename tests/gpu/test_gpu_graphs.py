"""CUDA-graph decode (engine/graphs.py): replays equal eager steps and transformers.

Every family, every expert resident (where graphs apply): greedy tokens equal transformers'
through graph replays, a batch of mixed lengths equals each prompt alone, and graphs were
really used. Run on the GPU machine with `bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetier import LLM
from tests.models.parity import (
    PROMPTS,
    check_parity,
    graphs_off,
    moe_kernels_apply,
    moetier_greedy,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_graph_decode_parity_with_transformers(ckpt: Path) -> None:
    check_parity(ckpt, None, device="cuda", cuda_graphs=True)


def test_graph_replays_equal_eager_steps(ckpt: Path) -> None:
    if graphs_off(ckpt):
        pytest.skip("host-sized attention: no CUDA graphs")
    kw = dict(expert_budget=None, device="cuda", dtype="float32", progress=False)
    eager = LLM(str(ckpt), cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt), cuda_graphs=True, **kw)
    want = moetier_greedy(eager, PROMPTS)
    assert moetier_greedy(graphs, PROMPTS) == want  # batch of mixed lengths
    # Replays count their steps, MoE calls and lookups as the eager steps do (capture: nothing)
    counted = ("_steps", "resident_lookups", "moe_calls", "token_lookups", "distinct_lookups")
    eager_stats, graph_stats = eager.offload_stats(), graphs.offload_stats()
    keys = [k for k in eager_stats if any(c in k for c in counted)]
    assert {k: graph_stats[k] for k in keys} == {k: eager_stats[k] for k in keys}
    assert [moetier_greedy(graphs, [p])[0] for p in PROMPTS] == want  # each alone
    runner = graphs.engine.runner
    assert runner.graphs is not None
    # a block without a kernel path (an activation the kernels lack) is not graph-safe: eager
    assert (runner.graphs.replays > 0) == moe_kernels_apply(ckpt), runner.graphs.replays
    assert not runner.graphs.failed, runner.graphs.failed
    assert eager.engine.runner.graphs is None


@pytest.mark.parametrize("budget", ["50%", "min"])
def test_piecewise_replays_equal_eager_steps(ckpt: Path, budget: str) -> None:
    """Offloaded decode as piecewise graphs (host fetches between MoE layers) computes what the
    eager offloaded step computes: same tokens batched and alone, same deterministic counts."""
    if graphs_off(ckpt):
        pytest.skip("host-sized attention: no CUDA graphs")
    from tests.models.parity import min_budget

    b = min_budget(ckpt) if budget == "min" else budget
    kw = dict(expert_budget=b, device="cuda", dtype="float32", progress=False)
    eager = LLM(str(ckpt), cuda_graphs=False, **kw)
    pieces = LLM(str(ckpt), piecewise_graphs=True, **kw)
    want = moetier_greedy(eager, PROMPTS)
    assert moetier_greedy(pieces, PROMPTS) == want  # batch of mixed lengths
    counted = ("_steps", "moe_calls", "token_lookups", "distinct_lookups")
    eager_stats, piece_stats = eager.offload_stats(), pieces.offload_stats()
    keys = [k for k in eager_stats if any(c in k for c in counted)]
    assert {k: piece_stats[k] for k in keys} == {k: eager_stats[k] for k in keys}
    assert [moetier_greedy(pieces, [p])[0] for p in PROMPTS] == want  # each alone
    graphs = pieces.engine.runner.graphs
    assert graphs is not None and not graphs.failed, graphs.failed
    assert (graphs.replays > 0) == moe_kernels_apply(ckpt), graphs.replays
    assert all(len(g.graphs) == graphs.moe_layers + 1 for g in graphs.graphs.values())
    pieces.engine.runner.expert_cache.check_integrity()


@pytest.mark.parametrize(
    "kw",
    [
        dict(expert_budget=None, cuda_graphs=True),
        dict(expert_budget="50%", piecewise_graphs=True),
        dict(expert_budget="50%", cuda_graphs=False),
    ],
    ids=["whole", "piecewise", "eager-offloaded"],
)
def test_overridden_routing_is_replayed_per_step(ckpt: Path, kw: dict) -> None:
    """The bench's routing override (ids from the host each call) is staged before each replay:
    graphs compute the drawn ids of every step, as eager does (a graph once replayed the ids
    captured with it, and a router swapped after capture was ignored)."""
    from moetier.bench.routing_override import UniformRouting, install

    def run(**extra: object) -> list[int]:
        llm = LLM(str(ckpt), device="cuda", dtype="float32", progress=False, **{**kw, **extra})
        moetier_greedy(llm, PROMPTS[:1])  # graphs captured with the model's own routers first
        runner = llm.engine.runner
        install(runner.model.moe_blocks(), UniformRouting(runner.num_experts, runner.top_k, 1))
        out = moetier_greedy(llm, PROMPTS[:1])[0]
        if runner.graphs is not None and kw.get("cuda_graphs") is not False:
            assert (runner.graphs.replays > 0) == moe_kernels_apply(ckpt)
            assert not runner.graphs.failed
        return out

    assert run() == run(expert_budget=None, cuda_graphs=False, piecewise_graphs=None)
