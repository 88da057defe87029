"""Faults: an expert that cannot be read mid-run (injected I/O error, truncated shard) and a bad
checkpoint at start-up. Held: the error names the file, only requests that need the lost bytes
fail, everything else completes with the reference tokens, the server stays up and /health says
what is degraded, and once the file is back nothing poisoned was left in the expert slots.

Runs as root here, so chmod 000 would not stop reads: an unreadable file is a truncation or an
injected EIO instead. On the CPU the host tier is 0 bytes, so experts are read from disk at run
time whenever they miss the device slots.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from moetier import LLM, SamplingParams
from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from tests.reliability.conftest import StartServer
from tests.server.conftest import DEVICE, LiveServer

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(3 + i)] for i in range(10)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(path: Path, **kw: Any) -> LLM:
    return LLM(str(path), device=DEVICE, dtype="float32", progress=False, **kw)


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    llm = _llm(tiny_model)
    return [_tokens(llm, p) for p in PROMPTS]


def _expert_ranges(ckpt: Checkpoint, layer: int, expert: int) -> list[tuple[Path, int, int]]:
    """(file, start, end) of every tensor of routed expert (layer, expert)."""
    tag, sub = f".layers.{layer}.", f".experts.{expert}."
    return [
        (info.file, info.offset, info.offset + info.nbytes)
        for name, info in ckpt.tensors.items()
        if tag in name and sub in name
    ]


def _inject_eio(llm: LLM, layer: int, expert: int) -> Any:
    """Reads of expert (layer, expert) raise EIO from now on; returns the real reader."""
    ckpt = llm.engine.runner.checkpoint
    bad = _expert_ranges(ckpt, layer, expert)
    assert bad, "expert tensors not found by name"
    real = ckpt.read_bytes_into

    def flaky(path: Path, offset: int, out: Any) -> None:
        if any(path == f and a <= offset < b for f, a, b in bad):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        real(path, offset, out)

    ckpt.read_bytes_into = flaky  # type: ignore[method-assign]
    return real


def _run_each(llm: LLM, reference: list[list[int]], check: bool) -> list[str]:
    outcomes: list[str] = []
    for prompt, ref in zip(PROMPTS, reference):
        try:
            assert _tokens(llm, prompt) == ref
            outcomes.append("ok")
        except RuntimeError as exc:
            assert "Input/output error" in str(exc) and "model.safetensors" in str(exc), exc
            outcomes.append("failed")
        assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()
        if check:
            llm.engine.check_integrity()
    return outcomes


def test_injected_io_error_names_the_file_and_the_engine_goes_on(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    llm = _llm(tiny_model, expert_budget="10%")  # a few slots: experts come from disk
    _inject_eio(llm, layer=1, expert=5)
    with pytest.raises(RuntimeError, match="Input/output error.*model.safetensors"):
        for prompt in PROMPTS:  # until one needs the expert
            _tokens(llm, prompt)
    assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()


def test_injected_io_error_fails_only_requests_that_need_it(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    llm = _llm(tiny_model, expert_budget="10%")
    real = _inject_eio(llm, layer=1, expert=5)
    outcomes = _run_each(llm, reference, check=True)
    assert "ok" in outcomes and "failed" in outcomes, outcomes
    llm.engine.runner.checkpoint.read_bytes_into = real  # type: ignore[method-assign]
    assert [_tokens(llm, p) for p in PROMPTS] == reference  # no slot kept half-read bytes


def _truncate_expert(path: Path) -> tuple[int, bytes]:
    """Cut the shard just inside the expert tensor stored last; (cut, removed bytes)."""
    ckpt = Checkpoint(path.parent)
    ends = [
        (info.offset, info.offset + info.nbytes)
        for name, info in ckpt.tensors.items()
        if ".experts." in name and info.file == path
    ]
    ckpt.close()
    start, _ = max(ends)
    cut = start + 4
    data = path.read_bytes()
    os.truncate(path, cut)
    return cut, data[cut:]


def _complete(server: LiveServer, prompt: list[int]) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _truncated_server(
    serve: StartServer, tiny_model: Path, tmp_path: Path, reference: list[list[int]]
) -> tuple[LiveServer, Path, bytes]:
    model = tmp_path / tiny_model.name
    shutil.copytree(tiny_model, model)
    server = serve(model, "--expert-budget", "10%")
    assert _complete(server, PROMPTS[0]).json()["choices"][0]["token_ids"] == reference[0]
    shard = model / "model.safetensors"
    _, removed = _truncate_expert(shard)
    return server, shard, removed


def _restore(shard: Path, removed: bytes) -> None:
    with shard.open("ab") as f:  # the file comes back (same inode: the open fd sees it)
        f.write(removed)


def test_shard_truncated_mid_run_others_complete(
    serve: StartServer, tiny_model: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    server, shard, removed = _truncated_server(serve, tiny_model, tmp_path, reference)
    codes = []
    for prompt, ref in zip(PROMPTS, reference):
        r = _complete(server, prompt)
        codes.append(r.status_code)
        if r.status_code == 200:
            assert r.json()["choices"][0]["token_ids"] == ref
        else:
            err = r.json()["error"]
            assert r.status_code == 500 and err["type"] == "server_error", r.text
            assert f"{shard}: unexpected end of file" in err["message"], r.text
    assert 500 in codes and 200 in codes[1:], codes
    assert server.proc.poll() is None
    health = httpx.get(f"{server.url}/health", timeout=10).json()  # cheap: says what and how many
    assert health["status"] == "degraded" and str(shard) in health["error"], health
    assert health["failed_requests"] == codes.count(500)
    health = server.health()  # integrity checks pass: nothing leaked by the failed steps
    assert health["status"] == "degraded" and health["kv_blocks_used"] == 0
    _restore(shard, removed)
    got = [_complete(server, p).json()["choices"][0]["token_ids"] for p in PROMPTS]
    assert got == reference


def _serve_fails(model: Path) -> str:
    cmd = [sys.executable, "-m", "moetier", "serve", str(model), "--device", "cpu", "--port", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    return out.stderr


def _sharded(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint behind an index that maps every tensor to model.safetensors."""
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_model, model)
    ckpt = Checkpoint(model)
    weight_map = {name: "model.safetensors" for name in ckpt.tensors}
    ckpt.close()
    index = {"metadata": {}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


def test_corrupt_index_or_missing_shard_named(tiny_model: Path, tmp_path: Path) -> None:
    model = _sharded(tiny_model, tmp_path)
    (model / "model.safetensors").rename(model / "elsewhere.bin")
    with pytest.raises(CheckpointError, match="missing: model.safetensors .* fix the index"):
        _llm(model)
    (model / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="index.json: not a valid safetensors index"):
        _llm(model)


def test_serve_with_truncated_shard_exits_2_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_model, model)
    shard = model / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    err = _serve_fails(model)
    assert "model.safetensors" in err and "truncated" in err
