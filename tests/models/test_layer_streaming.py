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
