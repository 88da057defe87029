"""Routing statistics of an MoE model over prompts: expert reuse between tokens and popularity.

`collect_routing` records, through transformers, which experts each token picks in each MoE
layer while the model greedily answers each prompt (chat template, one prompt at a time);
`summarize_routing` turns that trace into per-layer numbers; `format_routing_report` prints
them. Consecutive-token reuse is what makes an expert cache pay off: with top-k of E experts
it is k/E for random routing and 1.0 when every token picks the previous token's experts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# trace[prompt][layer][token] = the token's top-k expert ids in that MoE layer, best first
RoutingTrace = list[list[list[tuple[int, ...]]]]

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle works in a few sentences.",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for sleeping better.",
    "What is 12 times 12?",
    "Tell me a short story about a robot who learns to paint.",
    "Summarize the water cycle for a ten-year-old.",
]

_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class RoutingSummary:
    """Per-layer routing statistics; layer i is the model's i-th MoE layer."""

    num_experts: int
    top_k: int
    prompts: int
    tokens: int
    reuse: list[float]
    random_reuse: float
    popularity: list[list[int]]

    @property
    def mean_reuse(self) -> float:
        return sum(self.reuse) / len(self.reuse) if self.reuse else 0.0

    @property
    def reuse_vs_random(self) -> float:
        return self.mean_reuse / self.random_reuse


def _config_int(config: Any, keys: tuple[str, ...]) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"model config has none of {', '.join(keys)}: is this an MoE model?")


def find_routers(model: Any) -> list[Any]:
    """The router (gate) module of each MoE layer, in layer order; dense layers are skipped."""
    routers = []
    for layer in model.model.layers:
        block = getattr(layer, "block_sparse_moe", None)
        block = getattr(layer, "mlp", None) if block is None else block
        gate = getattr(block, "gate", None)
        gate = getattr(block, "router", None) if gate is None else gate
        if gate is not None and hasattr(block, "experts"):
            routers.append(gate)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE layers with a gate or router module")
    return routers


def _top_k_ids(output: Any, top_k: int) -> torch.Tensor:
    """[tokens, k] expert ids from a router's output: its own indices, else top-k of logits."""
    if isinstance(output, (tuple, list)):
        last = output[-1]
        if len(output) >= 3 and isinstance(last, torch.Tensor) and not last.is_floating_point():
            return last.reshape(-1, last.shape[-1])
        output = output[0]
    logits = output.reshape(-1, output.shape[-1])
    return logits.float().topk(top_k, dim=-1).indices


def greedy_chat(
    model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, device: Any = "cpu"
) -> None:
    """Greedy transformers generation of one chat prompt (routers are observed through hooks)."""
    from moetier.demo.calibration import chat_prompt_ids

    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
    )


def collect_routing_from_model(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int
) -> RoutingTrace:
    """Routing trace of a loaded transformers MoE model (see collect_routing)."""
    top_k = _config_int(model.config, _TOP_K_KEYS)
    routers = find_routers(model)
    steps: list[list[torch.Tensor]] = [[] for _ in routers]

    def hook_for(index: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            steps[index].append(_top_k_ids(output, top_k).cpu())

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    device = next(model.parameters()).device
    trace: RoutingTrace = []
    try:
        for prompt in prompts:
            for chunks in steps:
                chunks.clear()
            with torch.inference_mode():
                greedy_chat(model, tokenizer, prompt, max_new_tokens, device)
            trace.append(
                [[tuple(int(e) for e in row) for row in torch.cat(c).tolist()] for c in steps]
            )
    finally:
        for handle in handles:
            handle.remove()
    return trace


def load_model(model_dir: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) through transformers: float32 on CPU, the checkpoint's dtype on CUDA."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    # on CPU compute in float32: bfloat16 matmuls are very slow without AVX-512
    model = model.to("cuda") if torch.cuda.is_available() else model.float()
    return model.eval(), tokenizer


def collect_routing(model_dir: str | Path, prompts: list[str], max_new_tokens: int) -> RoutingTrace:
    """Per prompt, per MoE layer, per token: the top-k expert ids, with transformers.

    Each prompt runs alone through the chat template with greedy generation; the trace covers
    the prompt tokens then each generated token fed back (the last generated one is not fed).
    """
    model, tokenizer = load_model(model_dir)
    return collect_routing_from_model(model, tokenizer, prompts, max_new_tokens)


def summarize_routing(trace: RoutingTrace, num_experts: int, top_k: int) -> RoutingSummary:
    """Reuse (mean |S_t & S_t-1| / k over consecutive tokens of each prompt) and popularity."""
    if not trace or not trace[0]:
        raise ValueError("empty routing trace")
    layers = len(trace[0])
    if any(len(per_prompt) != layers for per_prompt in trace):
        raise ValueError("every prompt of a routing trace must cover the same layers")
    reuse: list[float] = []
    popularity: list[list[int]] = []
    for layer in range(layers):
        shared, pairs = 0, 0
        counts = [0] * num_experts
        for per_prompt in trace:
            tokens = per_prompt[layer]
            for prev, cur in zip(tokens, tokens[1:]):
                shared += len(set(prev) & set(cur))
                pairs += 1
            for chosen in tokens:
                for expert in chosen:
                    counts[expert] += 1
        reuse.append(shared / (pairs * top_k) if pairs else 0.0)
        popularity.append(counts)
    return RoutingSummary(
        num_experts=num_experts,
        top_k=top_k,
        prompts=len(trace),
        tokens=sum(len(per_prompt[0]) for per_prompt in trace),
        reuse=reuse,
        random_reuse=top_k / num_experts,
        popularity=popularity,
    )


def format_routing_report(summary: RoutingSummary) -> str:
    """A per-layer table: reuse, reuse over random, busiest and idlest expert, unused experts."""
    s = summary
    lines = [
        f"routing over {s.prompts} prompts, {s.tokens} tokens per layer: {s.num_experts} "
        f"experts, top-{s.top_k}; random routing reuses {s.random_reuse:.3f}",
        f"{'layer':>5}  {'reuse':>6}  {'x random':>8}  {'busiest':>12}  {'idlest':>12}  unused",
    ]
    for layer, (reuse, counts) in enumerate(zip(s.reuse, s.popularity)):
        total = max(sum(counts), 1)
        busiest = max(range(len(counts)), key=lambda e: (counts[e], -e))
        idlest = min(range(len(counts)), key=lambda e: (counts[e], e))
        lines.append(
            f"{layer:>5}  {reuse:>6.3f}  {reuse / s.random_reuse:>7.2f}x  "
            f"{f'#{busiest} {counts[busiest] / total:.1%}':>12}  "
            f"{f'#{idlest} {counts[idlest] / total:.1%}':>12}  {counts.count(0):>6}"
        )
    lines.append(f"{'mean':>5}  {s.mean_reuse:>6.3f}  {s.reuse_vs_random:>7.2f}x")
    return "\n".join(lines)


def run_routing_stats(
    model: str | None = None, prompts: list[str] | None = None, max_new_tokens: int = 32
) -> str:
    """The routing report of model (None: the demo model) over prompts (None: built-in set)."""
    if model is None:
        from moetier.demo.builder import ensure_demo_model

        model = str(ensure_demo_model())
    if not Path(model).is_dir():
        from moetier.errors import ConfigError

        raise ConfigError(f"model directory {model!r} does not exist; pass a local checkpoint")
    prompts = prompts or DEFAULT_PROMPTS
    model_obj, tokenizer = load_model(model)
    top_k = _config_int(model_obj.config, _TOP_K_KEYS)
    num_experts = _config_int(model_obj.config, _NUM_EXPERTS_KEYS)
    trace = collect_routing_from_model(model_obj, tokenizer, prompts, max_new_tokens)
    summary = summarize_routing(trace, num_experts, top_k)
    return f"model: {model}\n" + format_routing_report(summary)
