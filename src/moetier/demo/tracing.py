"""Real-text routing traces of demo variants, recorded without building the variant.

An unperturbed variant computes exactly the dense FFN whatever its router picks, so its hidden
states are the dense model's and its routing is the dense model's MoE inputs (each layer's
post-attention norm output) through the fit routers. `record_variant_trace` therefore runs the
dense SmolLM2 through transformers, greedily answering chat prompts one at a time (batch 1: a
prefill step, then one step per decode token fed back), applies each layer's router exactly as
transformers' Mixtral router does (float32 logits of the bfloat16-rounded router weight,
softmax, top-k) and returns a `moetier-trace` (format and writer: `moetier.bench.trace`).
A 128-expert trace thus costs a 135M-parameter dense decode, not a 20 GB checkpoint. The only
difference to the built variant is float rounding: the variant adds k copies of the FFN output
weighted by renormalized probabilities, which can flip near-tied routing decisions rarely.

With `predictions` each line also carries the gate-lookahead prediction for the next MoE layer
(format version 2): layer l+1's router applied to layer l's MoE input, the same float32 logits
of the bfloat16-rounded weight, top-k, best first, for every token of the call. Every router is
known and layer l's MoE input is at hand when layer l routes, so this is exactly what the
engine's `gate-lookahead` predictor would guess. The last MoE layer has no next layer in its
step: its lines omit `predicted`.
"""

from __future__ import annotations

import gzip
import logging
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from moetier.bench.routing import (
    DEFAULT_PROMPTS,
    RoutingSummary,
    greedy_chat,
    summarize_routing,
)
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, write_trace
from moetier.demo.variants import DemoSpec

log = logging.getLogger(__name__)

PROMPTS_NAME = "trace_prompts.txt"


def trace_prompts() -> list[str]:
    """bench.routing's built-in prompts, then the demo's shipped trace prompts (one a line)."""
    text = resources.files("moetier.demo").joinpath(PROMPTS_NAME).read_text("utf-8")
    extra = [line.strip() for line in text.splitlines() if line.strip()]
    return list(DEFAULT_PROMPTS) + [p for p in extra if p not in DEFAULT_PROMPTS]


class _RouterTap:
    """Forward hooks that route each layer's MoE input and emit one TraceRecord per layer call
    (with `predictions`, each also holding the next layer's router's top-k on that input)."""

    def __init__(
        self, model: Any, routers: list[torch.Tensor], top_k: int, predictions: bool = False
    ) -> None:
        self.layers = model.model.layers
        if len(routers) != len(self.layers):
            raise ValueError(f"{len(routers)} routers for {len(self.layers)} layers")
        # the checkpoint stores routers in bfloat16; the variant computes in float32
        self.weights = [r.to(torch.bfloat16).float() for r in routers]
        self.top_k = top_k
        self.predictions = predictions
        self.records: list[TraceRecord] = []
        self.step = 0
        self.request = 0
        self._handles: list[Any] = []

    def __enter__(self) -> _RouterTap:
        for i, layer in enumerate(self.layers):
            hook = self._hook_for(i)
            self._handles.append(layer.post_attention_layernorm.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _top_k(self, x: torch.Tensor, weight: torch.Tensor) -> list[list[int]]:
        """[T, K] ids, best first: top-k of softmax(x W^T), as the Mixtral router picks."""
        probs = torch.softmax(torch.nn.functional.linear(x, weight), dim=-1)  # [T, E]
        ids: list[list[int]] = probs.topk(self.top_k, dim=-1).indices.tolist()
        return ids

    def _hook_for(self, layer: int) -> Any:
        weight = self.weights[layer]
        last = layer + 1 == len(self.weights)
        ahead = None if last or not self.predictions else self.weights[layer + 1]

        def hook(module: Any, args: Any, output: torch.Tensor) -> None:
            # layer 0 opens a new step: one forward of the model = one engine step
            if layer == 0 and self.records:
                self.step += 1
            x = output.detach().reshape(-1, weight.shape[1]).float()  # [T, D]
            ids = self._top_k(x, weight)  # [T, K]
            predicted = None if ahead is None else self._top_k(x, ahead)  # layer l+1's, [T, K]
            requests = [self.request] * len(ids)
            self.records.append(TraceRecord(self.step, layer, requests, ids, predicted))

        return hook


def trace_routing(
    model: Any,
    tokenizer: Any,
    routers: list[torch.Tensor],
    header: TraceHeader,
    prompts: list[str],
    max_new_tokens: int,
    progress: bool = True,
    predictions: bool = False,
) -> RoutingTrace:
    """Greedy-answer each prompt (chat template, batch 1) and trace the routers' top-k choices
    (with `predictions`, also each call's next-layer lookahead: see the module docstring).

    Steps count up across prompts; request r is prompts[r]. The last generated token is not
    fed back, as in any engine: a prompt of P tokens answered with N tokens gives one prefill
    step of P tokens and N - 1 decode steps.
    """
    tap = _RouterTap(model, routers, header.top_k, predictions)
    bar = tqdm(prompts, desc="tracing prompts", unit="prompt", disable=not progress)
    with tap, torch.inference_mode():
        for request, prompt in enumerate(bar):
            tap.request = request
            greedy_chat(model, tokenizer, prompt, max_new_tokens)
    return RoutingTrace(header, tap.records)


@dataclass
class TraceStats:
    """What a recorded trace holds, and its consecutive-token reuse per MoE layer."""

    prompts: int
    prefill_tokens: int
    decode_tokens: int
    lines: int
    summary: RoutingSummary  # over every token, as `moetier routing-stats` counts
    decode_reuse: list[float]  # over consecutive decode tokens only


def per_request_routing(
    trace: RoutingTrace, decode_only: bool = False
) -> list[list[list[tuple[int, ...]]]]:
    """trace[request][layer index][token] = top-k ids, the shape bench.routing summarizes.

    decode_only keeps single-token calls only (batch-1 traces: the decode steps).
    """
    layer_index = {layer: i for i, layer in enumerate(trace.header.moe_layers)}
    out: dict[int, list[list[tuple[int, ...]]]] = {}
    for rec in trace.records:
        if decode_only and len(rec.experts) != 1:
            continue
        for request, row in zip(rec.requests, rec.experts):
            per_layer = out.setdefault(request, [[] for _ in layer_index])
            per_layer[layer_index[rec.layer]].append(tuple(row))
    return [out[r] for r in sorted(out)]


def trace_stats(trace: RoutingTrace) -> TraceStats:
    """Token counts (batch-1 traces: a call of more than one token is a prefill) and reuse."""
    first = trace.header.moe_layers[0]
    calls = [r for r in trace.records if r.layer == first]
    prefill = sum(len(r.experts) for r in calls if len(r.experts) > 1)
    decode = sum(len(r.experts) for r in calls if len(r.experts) == 1)
    e, k = trace.header.num_experts, trace.header.top_k
    routing = per_request_routing(trace)
    summary = summarize_routing(routing, e, k)
    decode_summary = summarize_routing(per_request_routing(trace, decode_only=True), e, k)
    return TraceStats(
        len(routing), prefill, decode, len(trace.records) + 1, summary, decode_summary.reuse
    )


def save_trace(trace: RoutingTrace, out: str | Path) -> Path:
    """Write trace as JSON Lines; gzip-compressed when out ends with .gz."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix != ".gz":
        write_trace(out, trace)
        return out
    with tempfile.TemporaryDirectory(prefix="moetier-trace-") as tmp:
        plain = Path(tmp) / "trace.jsonl"
        write_trace(plain, trace)
        with open(plain, "rb") as src, gzip.open(out, "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
    return out


def record_variant_trace(
    spec: DemoSpec,
    prompts: list[str] | None = None,
    max_new_tokens: int = 128,
    home: str | Path | None = None,
    progress: bool = True,
    predictions: bool = False,
) -> RoutingTrace:
    """The routing trace the unperturbed variant `spec` would produce, from the dense model.

    Fits the variant's routers exactly as `moetier build-demo --experts E --top-k K` does (same
    calibration, same seed), then traces `prompts` (None: `trace_prompts()`); `predictions`
    records each call's next-layer lookahead too (a version 2 trace).
    """
    from moetier.demo.builder import fit_demo_routers, load_bf16_dense, moetier_home
    from moetier.demo.variants import SOURCE_LAYERS

    model, tokenizer = load_bf16_dense(moetier_home(home))
    routers, _ = fit_demo_routers(model, tokenizer, spec, progress)
    header = TraceHeader(
        num_layers=SOURCE_LAYERS,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        moe_layers=list(range(SOURCE_LAYERS)),
        expert_bytes=spec.expert_bytes,
    )
    prompts = trace_prompts() if prompts is None else prompts
    return trace_routing(
        model, tokenizer, routers, header, prompts, max_new_tokens, progress, predictions
    )
