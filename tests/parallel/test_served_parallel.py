"""`moetier serve --expert-parallel-size 2` (CPU, gloo): concurrent greedy completions on a
cramped KV pool (preemption, chunked prefill) at a 50% budget per rank equal transformers'
tokens, which the one-rank server equals too (tests/server/test_family_parity_served.py); a
rank killed mid-stream ends the stream with a 503-class error naming the rank, /health and new
requests answer 503 with it, and the server stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.models.families import FAMILIES
from tests.server.conftest import launch_server, stop_server, wait_until_up
from tests.server.test_family_parity_served import check_served
from tests.server.tiny import VOCAB, save_byte_tokenizer


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "qwen3_5_moe"])
def test_served_two_ranks_equal_transformers(family: str, tmp_path: Path) -> None:
    check_served(family, tmp_path, "--expert-parallel-size", "2")


def _rank_pid(server_pid: int) -> int:
    """The rank-1 process: a `moetier.parallel.worker` below the server's engine process."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"moetier.parallel.worker" not in cmdline.read_bytes():
                continue
            ppid = int((cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
            grand = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if grand == server_pid:
            return int(cmdline.parent.name)
    raise AssertionError("no rank-1 process under the server's engine")


def test_killed_rank_gives_503_naming_it_and_a_clean_stop(tmp_path: Path) -> None:
    path = FAMILIES["qwen3_moe"].checkpoint(tmp_path / "m", vocab_size=VOCAB)
    save_byte_tokenizer(path)
    server = wait_until_up(
        launch_server(path, tmp_path / "server.log", "--expert-parallel-size", "2")
    )
    try:
        owned = FAMILIES["qwen3_moe"].routed_experts // 2  # round-robin over 2 ranks
        want = {
            f'moetier:rank_owned_experts{{model_name="m",rank="{r}"}} {owned:.1f}' for r in (0, 1)
        }
        deadline = time.monotonic() + 20
        while not want <= set(httpx.get(f"{server.url}/metrics").text.splitlines()):
            assert time.monotonic() < deadline, "no per-rank metrics"
            time.sleep(0.2)
        body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 240, "stream": True,
                "ignore_eos": True}  # fmt: skip
        events: list[str] = []
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:  # two chunks in: kill rank 1
                    os.kill(_rank_pid(server.proc.pid), signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["message"].startswith("rank 1 exited with code -9"), error
        assert error["type"] == "server_error"
        deadline = time.monotonic() + 10
        while (h := httpx.get(f"{server.url}/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert h.json()["status"] == "degraded" and "rank 1 exited" in h.json()["error"]
        r2 = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": [1]})
        assert r2.status_code == 503 and "rank 1 exited" in r2.json()["error"]["message"]
    finally:
        t0 = time.monotonic()
        code = stop_server(server)
    assert code == 0, server.log()
    assert time.monotonic() - t0 < 30
