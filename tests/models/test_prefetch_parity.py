"""Greedy tokens and logits equal transformers' with next-layer prefetch on: prefetched slots,
cancelled stale loads and background disk reads never change what a layer computes with.

The budget is three waves of top-k slots: at the minimum budget every slot is pinned by the
running wave, and a prefetch never evicts the target layer's own keys, so with two MoE layers
two waves leave it nothing to take."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from moetier.offload.expert_cache import ExpertCache
from moetier.offload.transfer import TransferEngine
from tests.models.families import FAMILIES
from tests.models.parity import check_parity, top_k


def waves_budget(path: Path, waves: int = 3, dtype_bytes: int = 4) -> str:
    cfg = json.loads((path / "config.json").read_text())
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    expert = 3 * cfg["hidden_size"] * inter * dtype_bytes
    return f"{waves * top_k(cfg) * expert}B"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_with_same_index_prefetch(family: str, tmp_path: Path) -> None:
    ckpt = FAMILIES[family].checkpoint(tmp_path / family)
    stats = check_parity(ckpt, waves_budget(ckpt), prefetch="same-index")
    assert stats["prefetches_issued"] > 0 and stats["disk_reads"] > 0
    assert stats["prefetches_used"] <= stats["prefetches_issued"]


@pytest.mark.parametrize("predictor", ["last-call", "activation", "gate-lookahead"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_parity_with_predictors(family: str, predictor: str, tmp_path: Path) -> None:
    ckpt = FAMILIES[family].checkpoint(tmp_path / family)
    stats = check_parity(ckpt, waves_budget(ckpt), prefetch=predictor)
    assert stats["prefetches_issued"] > 0
    if predictor == "gate-lookahead":  # the next router on this hidden state: often right
        assert stats["prefetches_used"] > 0


def test_parity_prefetch_two_ahead_with_host_tier(tmp_path: Path) -> None:
    family = FAMILIES["mixtral"]
    ckpt = family.checkpoint(tmp_path / "mixtral")
    expert_budget, host_budget = family.host_case
    stats = check_parity(
        ckpt, expert_budget, host_budget=host_budget, prefetch="gate-lookahead", prefetch_ahead=2
    )
    assert stats["host_rows"] == family.host_rows
    assert stats["prefetches_issued"] > 0 and stats["host_hits"] > 0


class _Event:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(30.0), "emulated copy never finished"


class ThreadStream:
    """A copy stream emulated on the CPU: copies run later on a thread, in issue order, each
    after a short sleep; `wait` blocks the computing thread until the event's copy is done.
    A layer that read a slot before its copy landed would compute with stale weights."""

    def __init__(self, delay_s: float = 0.0005) -> None:
        self.delay_s = delay_s
        self.queue: queue.Queue[tuple[Any, _Event]] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            chunks, event = self.queue.get()
            time.sleep(self.delay_s)
            for dst, src in chunks:
                dst.copy_(src)
            event._done.set()

    def copy(self, chunks: Any, after: Any) -> _Event:
        event = _Event()
        self.queue.put((list(chunks), event))
        return event

    def query(self, event: Any) -> bool:
        return event is None or event.query()

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def synchronize(self, event: Any) -> None:
        self.wait(event)


@pytest.mark.parametrize("host_budget", ["100%", "50%"])
def test_parity_with_an_asynchronous_copy_stream(host_budget: str, tmp_path: Path) -> None:
    """The CUDA protocol on the CPU: loads land later than they are issued, prefetch copies are
    chunked, queued, promoted and cancelled; tokens and logits still equal transformers'."""
    ckpt = FAMILIES["mixtral"].checkpoint(tmp_path / "mixtral")
    real_init = ExpertCache.__init__

    def init(self: ExpertCache, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.transfer = TransferEngine(ThreadStream(), chunk_bytes=4096, background=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExpertCache, "__init__", init)
        stats = check_parity(
            ckpt, waves_budget(ckpt), host_budget=host_budget, prefetch="gate-lookahead"
        )
    assert stats["prefetches_issued"] > 0 and stats["prefetches_used"] > 0
    assert stats["bytes_host_to_device"] > 0
