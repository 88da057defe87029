"""The recorder's hooks on a stand-in model: each call's ids and next-layer lookahead, exactly."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from moetier.demo.tracing import _RouterTap


def _model(layers: int) -> SimpleNamespace:
    """Only what the tap reads: model.model.layers[i].post_attention_layernorm."""
    blocks = [SimpleNamespace(post_attention_layernorm=nn.Identity()) for _ in range(layers)]
    return SimpleNamespace(model=SimpleNamespace(layers=blocks))


def test_tap_records_the_next_routers_top_k_on_this_layers_input() -> None:
    # 3 layers, 4 experts of hidden 2, top-2; router l scores expert e by w[l][e] . x
    routers = [
        torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]),
        torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, -1.0], [-3.0, 0.0]]),
        torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]]),
    ]
    model = _model(3)
    x = torch.tensor([[3.0, 1.0], [-1.0, -2.0]])  # [T=2, D=2]
    with _RouterTap(model, routers, top_k=2, predictions=True) as tap:
        for block in model.model.layers:  # one step: each layer's MoE input is x
            block.post_attention_layernorm(x)
    # scores: router 0 [3, 1, -3, -1] and [-1, -2, 1, 2]; router 1 [1, 6, -1, -9] and
    # [-2, -2, 2, 3]; router 2 [4, 2, -2, -4] and [-3, 1, -1, 3]
    r0, r1, r2 = [[0, 1], [3, 2]], [[1, 0], [3, 2]], [[0, 1], [3, 1]]
    assert [(r.step, r.layer, r.experts, r.predicted) for r in tap.records] == [
        (0, 0, r0, r1),  # layer 0's ids, and layer 1's router on layer 0's input
        (0, 1, r1, r2),
        (0, 2, r2, None),  # the last layer: no next MoE layer in the step
    ]
    with _RouterTap(model, routers, top_k=2) as plain:
        model.model.layers[0].post_attention_layernorm(x)
    assert plain.records[0].experts == r0 and plain.records[0].predicted is None
