"""ExpertLayout reads every checkpoint layout by offset into the same packed bytes.

One expert's weights are written per-expert, fused [E, 2I, D] + [E, D, I] and fused transposed
[E, D, 2I] + [E, I, D] (Llama 4) in three layers of one file; each packs to gate rows, up rows,
then down, byte for byte. D = 2I on purpose: the gate_up shapes of both fused layouts are equal,
only the down shape tells them apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.experts import ExpertLayout

E, D, N = 3, 8, 4  # experts, hidden, intermediate (I in shape comments)


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate [E, I, D], up [E, I, D], down [E, D, I], every element distinct (bf16-exact)."""
    n = E * N * D
    gate = torch.arange(n, dtype=torch.bfloat16).view(E, N, D)
    up = (torch.arange(n, dtype=torch.bfloat16) + n).view(E, N, D)
    down = (torch.arange(n, dtype=torch.bfloat16) - n).view(E, D, N)
    return gate, up, down


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> ExpertLayout:
    gate, up, down = _weights()
    tensors: dict[str, torch.Tensor] = {}
    for e in range(E):
        base = f"model.layers.0.mlp.experts.{e}"
        tensors[f"{base}.gate_proj.weight"] = gate[e].clone()
        tensors[f"{base}.up_proj.weight"] = up[e].clone()
        tensors[f"{base}.down_proj.weight"] = down[e].clone()
    gate_up = torch.cat([gate, up], dim=1)  # [E, 2I, D]
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = gate_up.contiguous()
    tensors["model.layers.1.mlp.experts.down_proj"] = down.contiguous()
    llama4 = "model.layers.2.feed_forward.experts"
    tensors[f"{llama4}.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()  # [E, D, 2I]
    tensors[f"{llama4}.down_proj"] = down.transpose(1, 2).contiguous()  # [E, I, D]
    path = tmp_path_factory.mktemp("layouts")
    save_file(tensors, str(path / "model.safetensors"))
    prefixes = {0: ["model.layers.0.mlp"], 1: ["model.layers.1.mlp"]}
    prefixes[2] = ["model.layers.2.feed_forward"]
    return ExpertLayout(Checkpoint(path), prefixes, num_experts=E)


def test_every_layout_packs_the_same_bytes(layout: ExpertLayout) -> None:
    gate, up, down = _weights()
    assert (layout.shape.hidden, layout.shape.intermediate) == (D, N)
    assert [layout.sources[i].transposed for i in range(3)] == [False, False, True]
    for e in range(E):
        want = torch.cat([gate[e].flatten(), up[e].flatten(), down[e].flatten()])
        for layer in range(3):
            out = torch.empty(layout.shape.numel, dtype=torch.bfloat16)
            nbytes = layout.read_into(layer, e, out)
            assert nbytes == layout.source_bytes(layer, e) == 3 * D * N * 2
            assert out.view(torch.uint8).tolist() == want.view(torch.uint8).tolist(), (layer, e)


def test_fused_shapes_of_neither_layout_are_refused(tmp_path: Path) -> None:
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, 2 * N, D),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(E, D, N + 1),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="neither"):
        ExpertLayout(Checkpoint(tmp_path), {0: ["model.layers.0.mlp"]}, num_experts=E)
