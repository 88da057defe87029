"""Next-layer prefetch: one MoE layer call's routing -> a predictor -> provider.prefetch.

Owns the glue only: which predictor, how many MoE layers ahead, and each token's request id for
the step. Never moves weights itself (the expert cache and transfer engine do) and never guesses
(offload/predict.py does). The MoE layer calls it on its miss path, after its own experts are
fetched and pinned, with the routing ids it already brought to the host: no extra sync.

Hash-routed layers (DeepSeek-V4's first MoE layers) are never guessed: `begin_step` gets the
step's token ids from the model runner (host ints it already has: no sync) and their experts
are looked up exactly (`HashRoutes`). Each is prefetched when a guess for that layer would be
(`ahead` MoE layers before it, through the same `provider.prefetch` at prefetch priority), the
first `ahead` MoE layers at the step's start. This is on with every predictor, not a separate
mode, because a known list beats any guess at no cost (a predictor's guesses for a hash layer are
dropped); `--prefetch hash` asks for it alone. Timed by `ahead` rather than all at the step's
start so a small slot pool is not filled with later layers' experts that push out earlier ones.
A model without hash routers has no `HashRoutes`: nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moetier.offload.predict import PREDICTORS, HashRoutes, Predictor, make_predictor
from moetier.offload.types import ExpertProvider


class Prefetcher:
    """Observes each MoE layer call and prefetches the predicted experts of the next layers."""

    def __init__(
        self,
        predictor: Predictor,
        provider: ExpertProvider,
        ahead: int = 1,
        hash_routes: HashRoutes | None = None,
        moe_layers: Sequence[int] = (),
    ) -> None:
        """`hash_routes`: the model's hash-routed layers (None: it has none); `moe_layers`: every
        MoE layer, whose first `ahead` are prefetched by `begin_step` if they are hash layers."""
        self.predictor = predictor
        self.provider = provider
        self.ahead = ahead
        self.hash_routes = hash_routes
        self.first_layers = sorted(moe_layers)[:ahead]
        # Request id of each token of the current step ([T]); set by the model runner per step.
        self.token_requests: list[int] | None = None

    def begin_step(self, token_ids: Sequence[int]) -> None:
        """A step of `token_ids` ([T], batch order) is about to run: look up the hash layers'
        experts and prefetch those of the first `ahead` MoE layers (no earlier call of the step
        can). The model runner calls it only when `hash_routes` is set."""
        routes = self.hash_routes
        assert routes is not None
        routes.begin_step(token_ids)
        for target in self.first_layers:
            self._prefetch(target, routes.experts(target))

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
            routes = self.hash_routes
            if routes is not None and target in routes.tables:
                # exact; a wrapped target is the next step's, whose begin_step prefetches it
                same_step = target > layer and routes.is_step(len(experts))
                self._prefetch(target, routes.experts(target) if same_step else [])
            else:
                self._prefetch(target, self.predictor.predict(layer, ahead, hidden))

    def _prefetch(self, layer: int, experts: list[int]) -> None:
        if experts:
            self.provider.prefetch(layer, experts)

    def end_request(self, request_id: int) -> None:
        self.predictor.end_request(request_id)


def build_prefetcher(
    name: str, moe_blocks: Sequence[Any], provider: ExpertProvider, ahead: int = 1
) -> Prefetcher:
    """The prefetcher of a model's MoE blocks with predictor `name`; the blocks' hash-routed
    layers (if any) are prefetched exactly."""
    return Prefetcher(
        build_predictor(name, moe_blocks),
        provider,
        ahead,
        HashRoutes.from_blocks(moe_blocks),
        [int(b.layer) for b in moe_blocks],
    )


def build_predictor(name: str, moe_blocks: Sequence[Any]) -> Predictor:
    """A predictor by registry name for a model's MoE blocks (anything with `.layer`; a
    predictor class with `from_blocks` builds itself from the blocks, e.g. their routers)."""
    factory: Any = PREDICTORS.get(name)
    if factory is not None and hasattr(factory, "from_blocks"):
        return factory.from_blocks(moe_blocks)  # type: ignore[no-any-return]
    return make_predictor(name, moe_layers=[int(b.layer) for b in moe_blocks])
