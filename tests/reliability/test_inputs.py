"""Library and CLI inputs: every bad value is refused with a clear error before any work starts.

Settings are checked against a model path that does not exist: the ConfigError (not a
CheckpointError) shows the check ran before the checkpoint was touched. NaN/inf logits failing
only their request is tested in tests/unit/test_engine_robust.py
(test_non_finite_logits_fail_only_that_request); an exception in one generate leaving the engine
usable in test_fault_mid_step_fails_requests_and_engine_keeps_serving.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from moetier import LLM, SamplingParams
from moetier.cli import main
from moetier.errors import ConfigError
from tests.models.families import FAMILIES

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "kw,phrase",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": NAN}, "temperature must be a finite number"),
        ({"temperature": INF}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": -1.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": NAN}, "top_p must be a finite number"),
        ({"top_k": -2}, "top_k must be -1, 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -5}, "max_tokens must be at least 1"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"seed": 2**64}, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
        ({"seed": -(2**63) - 1}, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids"),
    ],
)
def test_sampling_params_refuse(kw: dict[str, Any], phrase: str) -> None:
    with pytest.raises(ConfigError, match=phrase):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw,phrase",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"max_num_seqs": -3}, "max_num_seqs must be an integer >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an integer >= 1"),
        ({"kv_block_size": 0}, "kv_block_size must be an integer >= 1"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be an integer >= 1"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1"),
        ({"max_model_len": 1.5}, "max_model_len must be an integer >= 1"),
        ({"expert_budget": ""}, "expert budget: cannot parse ''"),
        ({"expert_budget": "lots"}, "expert budget: cannot parse 'lots'"),
        ({"expert_budget": "150%"}, "expert budget: '150%' is above 100%"),
        ({"expert_budget": "6 parsecs"}, "expert budget: unknown unit"),
        ({"expert_budget": -1}, "expert budget: must not be negative"),
        ({"expert_budget": 0.25}, "expert budget: ambiguous float"),
        ({"host_budget": "-5"}, "host budget: cannot parse '-5'"),
        ({"host_budget": True}, "host budget: expected bytes"),
        ({"policy": "nope"}, "unknown expert-cache policy 'nope'; choose one of"),
        ({"gpu_memory": "lots"}, "gpu_memory: cannot parse 'lots'"),
        ({"gpu_memory": 0.9}, "gpu_memory: ambiguous float"),
        ({"routing_trace": "t.jsonl"}, "set gpu_memory too"),
    ],
)
def test_llm_settings_refused_before_load(tmp_path: Path, kw: dict[str, Any], phrase: str) -> None:
    with pytest.raises(ConfigError, match=phrase):
        LLM(str(tmp_path / "not-read"), device="cpu", progress=False, **kw)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = FAMILIES["mixtral"].checkpoint(tmp_path_factory.mktemp("mixtral"))
    return LLM(str(path), device="cpu", dtype="float32", progress=False, max_model_len=16)


@pytest.mark.parametrize(
    "prompts,params,phrase",
    [
        ([list(range(1, 17))], None, "prompt has 16 tokens; this model's context is 16"),
        ([list(range(1, 7))], SamplingParams(max_tokens=11), "ask for at most 10"),
        ([[True, 2]], None, "a prompt must be a string or a list of token ids"),
        ([[1, 2.0]], None, "a prompt must be a string or a list of token ids"),
        ([[1, 2], [[3]]], None, "a prompt must be a string or a list of token ids"),
        ([[1, 2, 10_000]], None, r"out of range \[0, \d+\)"),
        ([[1, 2], []], SamplingParams(max_tokens=2), "prompt is empty"),
        ([[1, 2]], {"max_tokens": 2}, "params must be a SamplingParams"),
    ],
)
def test_generate_refuses_and_queues_nothing(
    llm: LLM, prompts: Any, params: Any, phrase: str
) -> None:
    with pytest.raises(ConfigError, match=phrase):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used == 0


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.5}, {"top_k": 3}, {"top_p": 0.9, "top_k": 5}])
def test_tiny_temperature_is_greedy(llm: LLM, extra: dict[str, Any]) -> None:
    """temperature 1e-40 would overflow logits / T to inf (softmax NaN); it samples as greedy."""
    prompt = [[3, 1, 4, 1, 5]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True, **extra)
    assert tiny.greedy
    out = llm.generate(prompt, tiny)
    assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert not SamplingParams(temperature=1e-3).greedy  # small but meaningful: still sampled


@pytest.mark.parametrize("top_p", [5e-324, 1e-30, 1e-7])
def test_tiny_top_p_keeps_the_top_token(llm: LLM, top_p: float) -> None:
    """top_p = 5e-324 (found by the fuzzer) rounded to 0 in float32 and dropped every token."""
    prompt = [[3, 1, 4, 1, 5]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tiny = SamplingParams(max_tokens=6, temperature=1.0, top_p=top_p, ignore_eos=True, seed=1)
    out = llm.generate(prompt, tiny)
    assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "flags,phrase",
    [
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
        (["--top-k", "-7"], "top_k must be -1, 0"),
        (["--expert-budget", "lots"], "expert budget: cannot parse"),
        (["--host-budget", "200%"], "host budget: '200%' is above 100%"),
        (["--policy", "nope"], "unknown expert-cache policy"),
    ],
)
def test_cli_generate_refuses_before_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], phrase: str
) -> None:
    code = main(["generate", "--model", str(tmp_path / "not-read"), "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("moetier: error: ")
    assert re.search(phrase, err), err


@pytest.mark.parametrize(
    "flags,phrase",
    [
        (["--port", "70000"], r"must be a TCP port in \[0, 65535\]"),
        (["--port", "x"], "invalid _port value"),
        (["--max-num-seqs", "0"], "must be at least 1"),
        (["--max-num-batched-tokens", "0"], "must be at least 1"),
        (["--kv-block-size", "0"], "must be at least 1"),
        (["--num-kv-blocks", "-1"], "must be at least 1"),
        (["--max-model-len", "0"], "must be at least 1"),
        (["--max-body-bytes", "0"], "must be at least 1"),
        (["--max-waiting", "-1"], "must be 0 or more"),
        (["--shutdown-grace-s", "-1"], "must be a finite number >= 0"),
        (["--shutdown-grace-s", "nan"], "must be a finite number >= 0"),
    ],
)
def test_cli_serve_flags_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], phrase: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path / "not-read"), *flags])
    assert exit_info.value.code == 2
    assert re.search(phrase, capsys.readouterr().err)
