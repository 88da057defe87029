"""Next-layer predictors scored on a live model, where hidden states exist (gate-lookahead).

Owns the measurement only: it runs prompts one at a time through `LLM.generate` (request r =
prompt r), hooks every MoE block for its router input and routing, and scores each predictor's
prediction for the next MoE layer call against that call's distinct experts, exactly as
`bench/replay.py` scores predictors on a trace (`score_predictions`). A routing trace has no
hidden states, so `gate-lookahead` is measured here and the others can be compared on the same
calls.

Python:

    from moetier.bench.lookahead import measure_predictors
    scores = measure_predictors("~/.cache/moetier/demo/smollm2-moe-16x2", prompts,
                                ["gate-lookahead", "last-call", "activation"], max_new_tokens=32)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.bench.replay import PredictionScore, Prefetch, score_predictions
from moetier.bench.trace import TraceRecord
from moetier.offload.predict import GateLookaheadPredictor, Predictor, make_predictor


@dataclass
class _Recorder:
    """Per MoE layer call: its record and every predictor's prediction for the next call."""

    predictors: dict[str, Predictor]
    limit: int | None = None
    request: int = 0
    step: int = 0
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> router input
    records: list[TraceRecord] = field(default_factory=list)
    preds: dict[str, list[Prefetch | None]] = field(default_factory=dict)

    def pre_hook(self, block: Any, args: tuple[Any, ...]) -> None:
        self.hidden[block.layer] = args[0].detach()

    def observe(self, layer: int, flat: list[int], k: int) -> None:
        if self.records and layer <= self.records[-1].layer:
            self.step += 1
        rows = [flat[i : i + k] for i in range(0, len(flat), k)]
        requests = [self.request] * len(rows)
        self.records.append(TraceRecord(self.step, layer, requests, rows))
        hidden = self.hidden.pop(layer, None)
        for name, p in self.predictors.items():
            p.observe(layer, flat, requests)
            target = p.target_layer(layer)
            guess = p.predict(layer, hidden=hidden, limit=self.limit)
            self.preds.setdefault(name, []).append(None if target is None else (target, guess))


def measure_predictors(
    model: str | Path,
    prompts: Sequence[str | list[int]],
    predictors: Sequence[str],
    max_new_tokens: int = 32,
    limit: int | None = None,
    **llm_kw: Any,
) -> dict[str, PredictionScore]:
    """Greedy-generate each prompt alone (every expert resident unless `llm_kw` says
    otherwise) and score each predictor's next-MoE-layer predictions (`limit` experts each;
    None: as many as the call had distinct ones)."""
    from moetier.core import SamplingParams
    from moetier.llm import LLM

    # Prefix caching off: a shared prefix (a chat template's) must still be routed and scored.
    defaults = {"expert_budget": "100%", "progress": False, "enable_prefix_caching": False}
    llm = LLM(str(model), **{**defaults, **llm_kw})
    blocks = list(llm.engine.runner.model.moe_blocks())
    layers = sorted(b.layer for b in blocks)
    made: dict[str, Predictor] = {}
    for name in predictors:
        if name == "gate-lookahead":
            made[name] = GateLookaheadPredictor.from_blocks(blocks)
        else:
            made[name] = make_predictor(name, moe_layers=layers)
    rec = _Recorder(made, limit)
    handles = [b.register_forward_pre_hook(rec.pre_hook) for b in blocks]
    for b in blocks:
        b.route_observer = rec.observe
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    try:
        for r, prompt in enumerate(prompts):
            rec.request = r
            llm.generate(prompt, params)
    finally:
        for h in handles:
            h.remove()
        for b in blocks:
            b.route_observer = None
    return {name: score_predictions(rec.records, rec.preds[name]) for name in predictors}
