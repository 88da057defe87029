"""Torch CPU threads (moetier/threads.py): the auto rule, validation, and LLM(threads=...)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moetier import LLM, threads
from moetier.cli import build_parser
from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.server.cli import _engine_args as engine_args
from tests.models.parity import make_checkpoint
from tests.unit.test_cli import TINY


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _machine(monkeypatch: pytest.MonkeyPatch, cores: int, load: float, others: float = 0.0) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(threads, "runnable_others", lambda: others)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize(
    ("cores", "load", "others", "expected"),
    [
        (2, 0.0, 0.0, 2),  # quiet: every core
        (2, 0.49, 0.0, 2),  # rounds half up: 0.49 is no core's worth
        (2, 0.5, 0.0, 1),
        (2, 2.0, 0.0, 1),  # two busy neighbours: one thread, not zero
        (2, 7.3, 0.0, 1),
        (8, 2.4, 0.0, 6),
        (8, 2.5, 0.0, 5),
        (8, 0.1, 3.0, 5),  # a neighbour that just started: the load average has not caught up
        (8, 3.0, 1.0, 5),  # the larger of the two
        (1, 0.0, 0.0, 1),
    ],
)
def test_choose_threads_auto_rule(
    monkeypatch: pytest.MonkeyPatch, cores: int, load: float, others: float, expected: int
) -> None:
    _machine(monkeypatch, cores, load, others)
    assert threads.choose_threads(None) == expected
    assert threads.choose_threads("auto") == expected


def test_choose_threads_request_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 2, 5.0)
    assert threads.choose_threads(3) == 3
    assert threads.choose_threads("4") == 4


def test_runnable_others_reads_proc_loadavg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.10 0.20 0.30 3/120 4567\n")
    monkeypatch.setattr(threads, "PROC_LOADAVG", str(loadavg))
    monkeypatch.setattr(threads, "_own_running", lambda: 1)
    monkeypatch.setattr(threads, "_SAMPLE_GAP_S", 0.0)
    assert threads.runnable_others() == 2.0  # 3 runnable, one of them this process
    monkeypatch.setattr(threads, "_own_running", lambda: 4)
    assert threads.runnable_others() == 0.0
    monkeypatch.setattr(threads, "PROC_LOADAVG", str(tmp_path / "absent"))
    assert threads.runnable_others() == 0.0


@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.0, True, "x", "0", "", [2]])
def test_bad_threads_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="threads"):
        threads.check_threads(bad)
    with pytest.raises(ConfigError, match="threads"):
        threads.choose_threads(bad)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_engine_config_refuses_bad_threads(bad: object) -> None:
    with pytest.raises(ConfigError, match="threads must be an integer >= 1"):
        EngineConfig(model="m", threads=bad)  # type: ignore[arg-type]
    assert EngineConfig(model="m", threads=3).threads == 3
    assert EngineConfig(model="m").threads is None


def test_llm_refuses_bad_threads_before_any_work() -> None:
    # model=None would build the demo model: the check must come first.
    with pytest.raises(ConfigError, match="threads"):
        LLM(None, threads=0)


def test_cli_threads_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "--threads", "3"]).threads == 3
    assert parser.parse_args(["generate", "--threads", "auto"]).threads is None
    assert parser.parse_args(["generate"]).threads is None
    args = parser.parse_args(["serve", "--threads", "2"])
    assert engine_args(args).threads == 2
    assert parser.parse_args(["bench", "latency", "--threads", "1"]).threads == 1
    for argv in (["generate", "--threads", "0"], ["serve", "--threads", "two"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert isinstance(threads.threads_arg("auto"), type(None))
    with pytest.raises(argparse.ArgumentTypeError):
        threads.threads_arg("-1")


def test_configure_leaves_cuda_and_omp_env_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 2, 0.0)
    torch.set_num_threads(2)
    assert threads.configure_threads(None, "cuda:0") is None
    assert threads.configure_threads(None, torch.device("cuda")) is None
    assert torch.get_num_threads() == 2
    assert threads.configure_threads(1, "cuda") == 1  # a request applies on CUDA too
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.configure_threads(None, "cpu") is None
    assert torch.get_num_threads() == 1


def test_configure_auto_applies_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 2, 2.0)  # loaded: one thread
    torch.set_num_threads(2)
    assert threads.configure_threads(None, torch.device("cpu")) == 1
    assert torch.get_num_threads() == 1
    _machine(monkeypatch, 3, 0.0)  # quiet
    assert threads.configure_threads(None, "cpu") == 3
    assert torch.get_num_threads() == 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("threads"), "mixtral", **TINY)


def test_llm_applies_threads(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(2)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", progress=False, threads=1)
    assert torch.get_num_threads() == 1
    assert llm.engine.threads == 1
    out1 = llm.generate([[1, 2, 3, 4]])[0].outputs[0].token_ids
    # auto on a machine made to look loaded: one core's worth left of three
    _machine(monkeypatch, 3, 2.0)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", progress=False)
    assert torch.get_num_threads() == 1
    _machine(monkeypatch, 3, 0.0)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", progress=False, threads=None)
    assert torch.get_num_threads() == 3
    assert llm.engine.threads == 3
    assert llm.generate([[1, 2, 3, 4]])[0].outputs[0].token_ids == out1  # same greedy tokens
