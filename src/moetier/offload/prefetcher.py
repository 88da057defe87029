"""Next-layer prefetch: one MoE layer call's routing -> a predictor -> provider.prefetch.

Owns the glue only: which predictor, how many MoE layers ahead, and each token's request id for
the step. Never moves weights itself (the expert cache and transfer engine do) and never guesses
(offload/predict.py does). The MoE layer calls it on its miss path, after its own experts are
fetched and pinned, with the routing ids it already brought to the host: no extra sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moetier.offload.predict import PREDICTORS, Predictor, make_predictor
from moetier.offload.types import ExpertProvider


class Prefetcher:
    """Observes each MoE layer call and prefetches the predicted experts of the next layers."""

    def __init__(self, predictor: Predictor, provider: ExpertProvider, ahead: int = 1) -> None:
        self.predictor = predictor
        self.provider = provider
        self.ahead = ahead
        # Request id of each token of the current step ([T]); set by the model runner per step.
        self.token_requests: list[int] | None = None

    def __call__(self, layer: int, experts: Sequence[int], hidden: torch.Tensor | None) -> None:
        """`experts`: the call's routed ids flat in token order ([T*K]); `hidden`: the layer's
        router input [T, D] (used by predictors that apply a router to it; None in a
        piecewise-graph replay, where such predictors guess nothing)."""
        requests = self.token_requests
        if requests is not None and (not requests or len(experts) % len(requests)):
            requests = None  # not this step's tokens: one anonymous request
        self.predictor.observe(layer, experts, requests)
        for ahead in range(1, self.ahead + 1):
            target = self.predictor.target_layer(layer, ahead)
            if target is None:
                break
            guess = self.predictor.predict(layer, ahead, hidden)
            if guess:
                self.provider.prefetch(target, guess)

    def end_request(self, request_id: int) -> None:
        self.predictor.end_request(request_id)


def build_predictor(name: str, moe_blocks: Sequence[Any]) -> Predictor:
    """A predictor by registry name for a model's MoE blocks (anything with `.layer`; a
    predictor class with `from_blocks` builds itself from the blocks, e.g. their routers)."""
    factory: Any = PREDICTORS.get(name)
    if factory is not None and hasattr(factory, "from_blocks"):
        return factory.from_blocks(moe_blocks)  # type: ignore[no-any-return]
    return make_predictor(name, moe_layers=[int(b.layer) for b in moe_blocks])
