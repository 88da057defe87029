"""Engine robustness: a failing step, abort, preemption and admission limits leave it serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetier import LLM, SamplingParams
from moetier.errors import ConfigError
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["mixtral"].checkpoint(tmp_path_factory.mktemp("mixtral"))


def _llm(path: Path, **kw: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", progress=False, **kw)


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    return _tokens(_llm(ckpt))


def test_fault_mid_step_fails_requests_and_engine_keeps_serving(
    ckpt: Path, reference: list[list[int]]
) -> None:
    llm = _llm(ckpt, expert_budget="50%")
    block = llm.engine.runner.model.moe_blocks()[1]
    real = block.forward
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # third step, after layer 0 already wrote this step's K/V
            raise OSError("injected expert read failure")
        return real(*args, **kwargs)

    block.forward = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected expert read failure"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_used == 0
    llm.engine.check_integrity()
    assert _tokens(llm) == reference


def test_abort_frees_blocks(ckpt: Path) -> None:
    llm = _llm(ckpt)
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    eng.step()
    assert eng.blocks.num_used > 0
    assert eng.abort(reqs[1].request_id) and not eng.abort(12345)
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    aborted = [d for d in deltas if d.request_id == reqs[1].request_id]
    assert [(d.finished, d.finish_reason) for d in aborted] == [(True, "abort")]
    assert eng.blocks.num_used == 0
    eng.check_integrity()


def test_preemption_gives_identical_tokens(ckpt: Path, reference: list[list[int]]) -> None:
    # 6 blocks of 4 tokens: three sequences of up to 25 tokens cannot all stay resident.
    llm = _llm(ckpt, num_kv_blocks=8, kv_block_size=4)
    assert _tokens(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_used == 0


def test_deltas_concatenate_to_the_output(ckpt: Path) -> None:
    llm = _llm(ckpt)
    eng = llm.engine
    req = eng.add_request(PROMPTS[0], GREEDY, logprobs=2)
    seen: list[int] = []
    lps = []
    while eng.has_unfinished():
        for d in eng.step():
            seen += d.token_ids
            lps += d.logprobs
    assert seen == req.output_token_ids
    assert [lp.token_id for lp in lps] == seen
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in lps)


def test_max_model_len_checked_at_admission(ckpt: Path) -> None:
    llm = _llm(ckpt, max_model_len=16)
    with pytest.raises(ConfigError, match="context is 16 tokens"):
        llm.generate([list(range(1, 17))], GREEDY)
    with pytest.raises(ConfigError, match="ask for at most 10"):
        llm.generate([list(range(1, 7))], SamplingParams(max_tokens=11))
    assert not llm.engine.has_unfinished()
