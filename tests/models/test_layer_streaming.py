"""Layer streaming (MoEBlock.stream_share): a layer call touching most of its layer's experts
prefetches every expert of the next MoE layer. Forced on the CPU here (on CUDA it is the
default with experts offloaded): greedy tokens still equal transformers, every streamed call is
counted, and calls below the share stream nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS, check_parity


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["qwen3_moe"].checkpoint(tmp_path_factory.mktemp("qwen3_moe"), seed=4)


def test_streaming_keeps_parity_and_counts(ckpt: Path) -> None:
    on = check_parity(ckpt, "75%", moe_stream_share=0.5, late_reads=False)
    assert on["streamed_calls"] > 0 and on["prefetches_streamed"] > 0
    assert on["prefetches_issued"] >= on["prefetches_streamed"]
    off = check_parity(ckpt, "75%", moe_stream_share=0.0, late_reads=False)
    assert off["streamed_calls"] == 0 == off["prefetches_streamed"]


def test_only_wide_calls_stream(ckpt: Path) -> None:
    # a share above what any call of these prompts reaches: nothing streams
    stats = check_parity(ckpt, "75%", moe_stream_share=1.01, prompts=PROMPTS[:1])
    assert stats["streamed_calls"] == 0


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 5 MoE layers of 8 experts (layer 0 is dense): at 50% (20 slots) a streamed step's
    # working set (40) is twice the pool, where the eviction order decides the loads
    family = FAMILIES["qwen3_moe"]
    path = tmp_path_factory.mktemp("qwen3_moe_deep")
    return family.checkpoint(path, seed=4, num_hidden_layers=6)


def test_stream_eviction_keeps_parity_and_loads_no_more(deep_ckpt: Path) -> None:
    """stream_eviction on and off: greedy tokens equal transformers' both ways (check_parity),
    with prompts streaming (a share of 0.6: 5 of 8 experts; a decode token's 4 do not), and
    the step order loads fewer experts (misses plus prefetches, exact on the CPU)."""
    loads = {}
    for on in (True, False):
        s = check_parity(deep_ckpt, "50%", moe_stream_share=0.6, late_reads=False,
                         stream_eviction=on)  # fmt: skip
        assert s["streamed_calls"] > 0
        loads[on] = int(s["requests"] - s["device_hits"] + s["prefetches_issued"])
    assert loads[True] <= loads[False]
    assert loads == {True: 1076, False: 1346}
