"""Prefix caching is exact: greedy tokens equal with it on and off (shared prefixes, preemption,
chunked prefill, MLA), and the prefix cache counters count exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from moetier import LLM, SamplingParams
from moetier.metrics import ServerMetrics
from tests.models.families import FAMILIES
from tests.models.parity import hf_greedy, hf_model

BASE = [1, 5, 9, 33, 100, 7, 8, 9, 10, 11, 12, 13]  # 3 full blocks of 4
PROMPTS = [
    BASE + [40, 41, 42],
    BASE[:8] + [60, 61],
    BASE,
    [200] + BASE[1:],  # same blocks after another first token: no hit
    BASE + [40, 41, 42, 43, 44],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix")
    return {f: FAMILIES[f].checkpoint(root / f) for f in ("mixtral", "deepseek_v2")}


def _llm(path: Path, on: bool, **kw: Any) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        progress=False,
        kv_block_size=4,
        enable_prefix_caching=on,
        **kw,
    )


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("family", "kw"),
    [
        ("mixtral", dict(max_num_seqs=2)),  # later prompts admitted after earlier ones ran
        ("mixtral", dict(max_num_seqs=4, num_kv_blocks=8)),  # 32 tokens: preemptions
        ("mixtral", dict(max_num_seqs=2, max_num_batched_tokens=5)),  # chunked prefill
        ("deepseek_v2", dict(max_num_seqs=2, num_kv_blocks=8)),  # MLA's latent cache
    ],
)
def test_tokens_equal_with_prefix_caching_on_and_off(
    family: str, kw: dict[str, Any], checkpoints: dict[str, Path]
) -> None:
    runs = {}
    for on in (False, True):
        llm = _llm(checkpoints[family], on, **kw)
        # the second call reuses the first's blocks (finished requests keep theirs cached)
        runs[on] = _greedy(llm, PROMPTS[:2]) + _greedy(llm, PROMPTS)
        llm.engine.check_integrity()
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0
        if on:
            assert stats["prefix_cache_hits"] > 0
        else:
            assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0
        if "num_kv_blocks" in kw:
            assert stats["num_preemptions"] > 0
    assert runs[True] == runs[False]
    ref = hf_model(checkpoints[family])
    assert runs[True] == [hf_greedy(ref, p, 12) for p in PROMPTS[:2] + PROMPTS]


def test_prefix_cache_counters_count_exactly(checkpoints: dict[str, Path]) -> None:
    llm = _llm(checkpoints["mixtral"], True)
    first = _greedy(llm, [BASE], 3)[0]
    # 12 prompt tokens + 2 computed outputs: blocks BASE[0:4], [4:8], [8:12] cached, the 4th
    # (2 of 4 tokens) not; the same prompt reuses 2 blocks (its last token is recomputed)
    assert _greedy(llm, [BASE], 3)[0] == first
    longer = [*BASE, *first[:2], 77]  # 15 tokens: 3 blocks hit, the output block is partial
    _greedy(llm, [longer], 3)
    _greedy(llm, [PROMPTS[3]], 3)  # no hit
    s = llm.offload_stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (12 + 12 + 15 + 12, 8 + 12)
    llm.engine.check_integrity()
    metrics = ServerMetrics("tiny")
    metrics.update_engine(llm.engine.stats())
    text = generate_latest(metrics.registry).decode()
    assert 'moetier:prefix_cache_queries_total{model_name="tiny"} 51.0' in text
    assert 'moetier:prefix_cache_hits_total{model_name="tiny"} 20.0' in text
    assert 'moetier:kv_cache_blocks_cached{model_name="tiny"}' in text


def test_an_aborted_chunked_prefill_leaves_only_computed_blocks(
    checkpoints: dict[str, Path],
) -> None:
    llm = _llm(checkpoints["mixtral"], True, max_num_batched_tokens=6)
    eng = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = eng.add_request(PROMPTS[4], params)  # 17 tokens: chunks of 6
    eng.step()
    eng.step()  # 12 tokens computed: 3 blocks cached
    assert req.num_computed_tokens == 12 and len(eng.blocks.hash_of) == 3
    assert eng.abort(req.request_id)
    eng.step()
    eng.check_integrity()
    assert (eng.blocks.num_used, eng.blocks.num_cached) == (0, 3)
    got = _greedy(llm, [PROMPTS[4]], 4)
    assert eng.scheduler.prefix_cache_hits == 12
    assert got == _greedy(_llm(checkpoints["mixtral"], False), [PROMPTS[4]], 4)
