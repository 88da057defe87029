"""Next-layer expert predictors: small pure-Python classes behind a registry.

Owns guessing which experts an upcoming MoE layer call will need; it never moves weights (the
prefetcher and the transfer engine act on its guesses) and never imports engine code.

Contract (every predictor):

- `observe(layer, experts, requests=None)`: the routing of one MoE layer call, in call order.
  `experts` are the call's routed ids flat in token order (`[T*K]`, as `MoEBlock.route_observer`
  gets them); `requests` gives each token's request id (`[T]`) or is None (all tokens one
  anonymous request; then a list of distinct experts is fine too).
- `predict(layer, ahead=1, hidden=None, limit=None)`: experts predicted for the MoE layer
  `ahead` MoE layers after `layer` in the model's MoE layer order (wrapping to the next step's
  first layers), best first. Called after `observe(layer, ...)`. `hidden` is the input of
  `layer`'s router (`[T, D]`), used by `gate-lookahead` only. Without `limit` the list holds as
  many experts as `layer`'s last call had distinct ones (the current batch's width); `limit`
  caps it.
- `reset()`: forget everything (a new run).

`layer` is the model's layer index, as in `ExpertKey` and in routing traces. The MoE layer
order comes from `moe_layers=` or is learned from the calls observed (ascending layer ids).

Registry: `same-index` (the baseline: the next layer needs the expert ids this one used -- no
basis in standard MoEs, kept to measure against), `last-call` (the reference: the target layer
needs what its own previous call used), `activation` (per-request expert activation
matrices matched against a library of finished requests', after MoE-Infinity),
`gate-lookahead` (the target layer's router applied to this layer's router input), and `hash`
(no guess at all: only the exact prefetch of hash-routed layers, below).

Hash-routed layers (DeepSeek-V4's first layers: token t goes to experts `tid2eid[t]`) need no
guess: `HashRoutes` looks their experts up from the step's token ids before any layer runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from moetier.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from moetier.offload.activation import ActivationTracker


class Predictor:
    """Predicts the experts of upcoming MoE layer calls from the routing seen so far."""

    name = "predictor"
    needs_hidden = False  # True: predicts nothing without the router input (not from a trace)
    needs_token_ids = False  # True: predicts nothing without the step's token ids (same)

    def __init__(self, moe_layers: Sequence[int] | None = None) -> None:
        self._fixed_layers = list(moe_layers) if moe_layers is not None else None
        self._layers: list[int] = sorted(self._fixed_layers or [])
        self._index: dict[int, int] = {la: i for i, la in enumerate(self._layers)}
        self._width: dict[int, int] = {}  # layer -> distinct experts of its last call

    # the interface
    def observe(
        self, layer: int, experts: Sequence[int], requests: Sequence[int] | None = None
    ) -> None:
        self._learn_layer(layer)
        self._width[layer] = len(set(experts))
        self._observe(layer, experts, requests)

    def predict(
        self,
        layer: int,
        ahead: int = 1,
        hidden: torch.Tensor | None = None,
        limit: int | None = None,
    ) -> list[int]:
        target = self.target_layer(layer, ahead)
        if target is None:
            return []
        n = self._width.get(layer, 0) if limit is None else limit
        if n <= 0:
            return []
        return self._predict(layer, target, n, hidden)[:n]

    def end_request(self, request_id: int) -> None:
        """The engine is done with `request_id` (finished, aborted or failed); optional hook."""

    def ends_reported(self) -> None:
        """As `Policy.ends_reported`: every end comes through `end_request` (optional hook)."""

    def reset(self) -> None:
        self._layers = sorted(self._fixed_layers or [])
        self._index = {la: i for i, la in enumerate(self._layers)}
        self._width = {}
        self._reset()

    def target_layer(self, layer: int, ahead: int = 1) -> int | None:
        """The MoE layer `ahead` MoE layers after `layer` (wrapping around), None if unknown."""
        i = self._index.get(layer)
        if i is None or ahead < 1:
            return None
        return self._layers[(i + ahead) % len(self._layers)]

    # subclasses
    def _observe(self, layer: int, experts: Sequence[int], requests: Sequence[int] | None) -> None:
        pass

    def _predict(self, layer: int, target: int, n: int, hidden: torch.Tensor | None) -> list[int]:
        raise NotImplementedError

    def _reset(self) -> None:
        pass

    def _learn_layer(self, layer: int) -> None:
        if layer in self._index:
            return
        self._layers = sorted({*self._layers, layer})
        self._index = {la: i for i, la in enumerate(self._layers)}


def _ranked(experts: Sequence[int]) -> list[int]:
    """Distinct experts by how many tokens chose them, then by first appearance."""
    count: dict[int, int] = {}
    for e in experts:
        count[e] = count.get(e, 0) + 1
    return sorted(count, key=lambda e: -count[e])  # sorted is stable: first appearance


class SameIndexPredictor(Predictor):
    """Baseline: the target layer needs the expert ids `layer` just used (most tokens first).

    Expert ids of different layers are unrelated in standard MoEs; this is what MoE-Infinity's
    open-source prefetch does, kept as the floor to measure the others against.
    """

    name = "same-index"

    def __init__(self, moe_layers: Sequence[int] | None = None) -> None:
        super().__init__(moe_layers)
        self._last: dict[int, list[int]] = {}

    def _observe(self, layer: int, experts: Sequence[int], requests: Sequence[int] | None) -> None:
        self._last[layer] = _ranked(experts)

    def _predict(self, layer: int, target: int, n: int, hidden: torch.Tensor | None) -> list[int]:
        return self._last.get(layer, [])

    def _reset(self) -> None:
        self._last = {}


class LastCallPredictor(SameIndexPredictor):
    """Reference: the target layer needs what its own previous call used (most tokens first).

    Consecutive tokens reuse 35-50% of a layer's experts on real text, so this is the bar a
    learned predictor has to clear at batch 1. Same memory as same-index, other layer read.
    """

    name = "last-call"

    def _predict(self, layer: int, target: int, n: int, hidden: torch.Tensor | None) -> list[int]:
        return self._last.get(target, [])


class ActivationPredictor(Predictor):
    """Experts the target layer is expected to need by the requests of the last call, from
    their expert activation matrices (layers x experts counts so far) blended with the most
    similar finished requests' matrices (cosine similarity; `offload/activation.py`, shared
    with the `activation` eviction policy)."""

    name = "activation"

    def __init__(self, moe_layers: Sequence[int] | None = None, **tracker_kw: Any) -> None:
        super().__init__(moe_layers)
        from moetier.offload.activation import ActivationTracker

        # Recent tokens say most about the next ones: own counts decay with a one-token
        # half-life unless told otherwise (measured on the demo traces: precision 0.47 vs
        # 0.38 with plain counts; the library adds ~3 points of precision, ~7 of recall).
        self._tracker_kw = {"half_life_tokens": 1.0, **tracker_kw}
        self.tracker: ActivationTracker = ActivationTracker(**self._tracker_kw)
        self._active: list[int] = []  # requests of the last call

    def _observe(self, layer: int, experts: Sequence[int], requests: Sequence[int] | None) -> None:
        self._active = self.tracker.observe(layer, experts, requests)

    def _predict(self, layer: int, target: int, n: int, hidden: torch.Tensor | None) -> list[int]:
        return self.tracker.top_experts(target, self._active, n)

    def end_request(self, request_id: int) -> None:
        self.tracker.end_request(request_id)  # its matrix joins the library now

    def ends_reported(self) -> None:
        self._tracker_kw["retire_absent"] = False  # kept across reset()
        self.tracker.retire_absent = False

    def _reset(self) -> None:
        from moetier.offload.activation import ActivationTracker

        self.tracker = ActivationTracker(**self._tracker_kw)
        self._active = []


Router = Callable[["torch.Tensor"], Any]


class GateLookaheadPredictor(Predictor):
    """The target layer's router applied to `layer`'s router input: residual streams change
    little from one layer to the next, so the next router's choice on this layer's hidden state
    is a good guess (published: ~80-97% of next-layer experts).

    `routers` maps a MoE layer id to a callable `hidden [T, D] -> ids [T, K]` or
    `-> (ids [T, K], weights [T, K])` (the family routers in `layers/moe.py` and
    `layers/deepseek_router.py` return the pair); `from_blocks` builds it from a model's MoE
    blocks (`model.moe_blocks()`). Without a hidden state it predicts nothing.
    """

    name = "gate-lookahead"
    needs_hidden = True

    def __init__(
        self, routers: Mapping[int, Router] | None = None, moe_layers: Sequence[int] | None = None
    ) -> None:
        self.routers: dict[int, Router] = dict(routers or {})
        super().__init__(moe_layers if moe_layers is not None else sorted(self.routers) or None)

    @classmethod
    def from_blocks(cls, blocks: Sequence[Any]) -> GateLookaheadPredictor:
        """From MoE blocks (anything with `.layer` and a `.gate` router module). A router that
        routes by token id (`needs_token_ids`: DeepSeek-V4's hash layers) cannot route a hidden
        state: its layer gets no prediction."""
        routers = {
            int(b.layer): b.gate for b in blocks if not getattr(b.gate, "needs_token_ids", False)
        }
        # every MoE layer in the order, so a hash layer is a target (of no guess) from step one
        return cls(routers, moe_layers=sorted(int(b.layer) for b in blocks))

    def _predict(self, layer: int, target: int, n: int, hidden: torch.Tensor | None) -> list[int]:
        router = self.routers.get(target)
        if hidden is None or router is None:
            return []
        import torch

        with torch.no_grad():
            out = router(hidden)
        ids = out[0] if isinstance(out, tuple) else out  # [T, K]
        return _ranked(ids.flatten().tolist())


class HashOnlyPredictor(Predictor):
    """`hash`: guesses nothing. Whatever the predictor, the prefetcher prefetches hash-routed
    layers exactly (`HashRoutes`, offload/prefetcher.py), since a known expert list beats any
    guess and costs no sync; this name asks for that alone, with no guessed loads for the
    learned-router layers (no bandwidth or slots spent on wrong guesses). A model without
    hash-routed layers would prefetch nothing: refused."""

    name = "hash"
    needs_token_ids = True

    @classmethod
    def from_blocks(cls, blocks: Sequence[Any]) -> HashOnlyPredictor:
        layers = [int(b.layer) for b in blocks]
        if not any(getattr(b.gate, "needs_token_ids", False) for b in blocks):
            raise ConfigError(
                "--prefetch hash prefetches hash-routed MoE layers (DeepSeek-V4's first "
                "layers), and this model has none; pick another predictor or leave prefetch off"
            )
        return cls(layers)

    def _predict(self, layer: int, target: int, n: int, hidden: torch.Tensor | None) -> list[int]:
        return []


class HashRoutes:
    """The experts of hash-routed MoE layers for the current step, exactly: such a layer sends
    token t to `tid2eid[t]` whatever the hidden state, so once the step's token ids are known
    (the scheduler's batch, on the host) every hash layer's experts are. The tables are copied
    to the host once, at build: a step's lookup is CPU indexing, never a device sync."""

    def __init__(self, tables: Mapping[int, torch.Tensor]) -> None:
        import torch

        # [V, K] int32 per hash layer (the released V4: 129280 x 6, 3 MB a layer)
        self.tables = {int(la): t.detach().to("cpu", torch.int32) for la, t in tables.items()}
        widths = {t.shape[1] for t in self.tables.values()}
        assert len(widths) <= 1, "hash layers of one model route to the same number of experts"
        self.top_k = widths.pop() if widths else 0
        self.tokens = 0  # tokens of the current step
        self._experts: dict[int, list[int]] = {}

    @classmethod
    def from_blocks(cls, blocks: Sequence[Any]) -> HashRoutes | None:
        """From MoE blocks whose router `needs_token_ids` (it holds `tid2eid` [V, K]); None for a
        model without hash-routed layers."""
        tables = {
            int(b.layer): b.gate.tid2eid
            for b in blocks
            if getattr(b.gate, "needs_token_ids", False)
        }
        return cls(tables) if tables else None

    def begin_step(self, token_ids: Sequence[int]) -> None:
        """The step's token ids ([T], in batch order): each hash layer's distinct experts in
        ascending order, the order its fetch asks for them (MoEBlock: waves of ascending
        experts), so a prefetch that runs out of slots brings the first wave's, not experts
        that wave would evict before their turn."""
        import torch

        ids = torch.tensor(list(token_ids), dtype=torch.long)  # [T]
        self.tokens = len(ids)
        self._experts = {la: table[ids].unique().tolist() for la, table in self.tables.items()}

    def experts(self, layer: int) -> list[int]:
        """The current step's experts of hash layer `layer` ([] for any other layer)."""
        return self._experts.get(layer, [])

    def is_step(self, pairs: int) -> bool:
        """Whether a MoE call of `pairs` routed (token, expert) pairs is this step's."""
        return self.tokens > 0 and pairs == self.tokens * self.top_k


PREDICTORS: dict[str, Callable[..., Predictor]] = {
    "same-index": SameIndexPredictor,
    "last-call": LastCallPredictor,
    "activation": ActivationPredictor,
    "gate-lookahead": GateLookaheadPredictor,
    "hash": HashOnlyPredictor,
}


def make_predictor(name: str, **kw: Any) -> Predictor:
    """A predictor by registry name; `kw` go to its constructor (e.g. `moe_layers=`, or
    `routers=` for `gate-lookahead`)."""
    try:
        factory = PREDICTORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown expert predictor {name!r}; choose one of {', '.join(sorted(PREDICTORS))}"
        ) from None
    return factory(**kw)
