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
from tests.models.parity import PROMPTS, check_parity, moetier_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_graph_decode_parity_with_transformers(ckpt: Path) -> None:
    check_parity(ckpt, None, device="cuda", cuda_graphs=True)


def test_graph_replays_equal_eager_steps(ckpt: Path) -> None:
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
    assert runner.graphs.replays > 0 and not runner.graphs.failed, runner.graphs.failed
    assert eager.engine.runner.graphs is None
