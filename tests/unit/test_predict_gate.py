"""gate-lookahead on a live tiny model: exact when the hidden state does not change between
layers, scored like the trace predictors otherwise (`bench/lookahead.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from moetier.bench.lookahead import measure_predictors
from tests.models.families import FAMILIES

PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 200, 31]]
NAMES = ["gate-lookahead", "same-index", "last-call", "activation"]


def _frozen_residual(path: Path) -> None:
    """Zero every attention output and expert down projection and give all post-attention
    norms layer 0's weights: each layer adds nothing to the residual stream, so every MoE layer
    sees the same router input and only the routers differ."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    norm0 = tensors["model.layers.0.post_attention_layernorm.weight"]
    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", ".w2.weight")):
            t.zero_()
        elif name.endswith("post_attention_layernorm.weight"):
            t.copy_(norm0)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = FAMILIES["mixtral"].checkpoint(tmp_path_factory.mktemp("frozen"))
    _frozen_residual(path)
    return path


def test_gate_lookahead_is_exact_when_the_hidden_state_does_not_change(frozen: Path) -> None:
    # limit = all 8 experts: each prediction is every expert the router picks for some token
    got = measure_predictors(frozen, PROMPTS, NAMES, max_new_tokens=4, limit=8, dtype="float32")
    gate = got["gate-lookahead"]
    # Layers 1 and 2 are predicted from the layer before within the same token: exact.
    for layer in (1, 2):
        predicted, actual, correct = gate.by_layer[layer]
        assert predicted == actual == correct > 0
    # Layer 0 is predicted from layer 2 of the token before (the next step): not the same input.
    predicted, actual, correct = gate.by_layer[0]
    assert correct < actual
    # The routers differ per layer, so copying ids across layers is not exact here.
    same = got["same-index"]
    assert same.by_layer[1][2] < same.by_layer[1][1] or same.by_layer[2][2] < same.by_layer[2][1]


def test_gate_lookahead_scored_on_a_normal_checkpoint(tmp_path: Path) -> None:
    path = FAMILIES["mixtral"].checkpoint(tmp_path / "mixtral")
    got = measure_predictors(path, PROMPTS, NAMES, max_new_tokens=4, dtype="float32")
    gate = got["gate-lookahead"]
    assert gate.actual == got["same-index"].actual > 0  # every predictor scored on the same calls
    assert 0.0 <= gate.precision <= 1.0 and gate.correct < gate.actual  # not exact any more
