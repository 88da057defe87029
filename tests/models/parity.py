"""Shared harness for family parity tests: tiny HF checkpoints and reference generation.

Every family test builds a tiny random checkpoint with transformers itself and compares
moetier's greedy tokens and logits with transformers' on the same files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from moetier import LLM, SamplingParams

PROMPTS: list[list[int]] = [
    [1, 5, 9, 33, 100, 7],
    [7, 8, 9],
    [200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 250, 17],
]
NEW_TOKENS = 32


def make_checkpoint(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random `model_type` checkpoint (float32, per-expert layout) to `path`."""
    config = AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.save_pretrained(path)
    return path


def randomize(model: torch.nn.Module) -> None:
    """Spread every weight so routing and outputs are far from ties (HF init is tiny)."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(p.shape[-1], 1) ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (HF: 1)
                b.copy_(0.5 + 0.5 * torch.rand(b.shape, generator=g))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing table (HF: zeros)
                vocab, k = b.shape
                experts = int(model.config.n_routed_experts)
                rows = [torch.randperm(experts, generator=g)[:k] for _ in range(vocab)]
                b.copy_(torch.stack(rows))  # k distinct experts per token id


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ROLE = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


def fuse_experts(path: Path) -> None:
    """Rewrite a single-file checkpoint into the fused `experts.gate_up_proj`/`down_proj` layout."""
    tensors = load_file(str(path / "model.safetensors"))
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[_ROLE[m.group(3)]] = t
        else:
            out[name] = t
    for prefix, experts in groups.items():
        ids = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate"], experts[e]["up"]], dim=0) for e in ids]
        ).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in ids]).contiguous()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def hf_last_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt], device=model.device)).logits[0, -1].float().cpu()


def text_config(path: Path) -> dict[str, Any]:
    """config.json, or its text_config where a multimodal wrapper holds the text model's."""
    cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    return cfg.get("text_config") or cfg


def top_k(cfg: dict[str, Any]) -> int:
    """Experts per token from a config.json (Gemma 4 names it top_k_experts)."""
    return int(cfg.get("num_experts_per_tok") or cfg["top_k_experts"])


def moe_kernels_apply(path: Path) -> bool:
    """Whether the MoE kernels (slot, grouped) compute this checkpoint's experts: silu-gated
    ones (gpt-oss's and DeepSeek-V4's clamped SwiGLUs too: their configs say silu) and Gemma
    4's gelu_pytorch_tanh ones, in any stored format (gpt-oss's MXFP4 included); another
    activation always takes the loop."""
    cfg = text_config(path)
    act = cfg.get("hidden_act") or cfg.get("hidden_activation")
    return act in ("silu", "gelu_pytorch_tanh")


def recurrent_state(path: Path) -> bool:
    """Whether the checkpoint's model keeps per-sequence recurrent state (hybrid linear
    attention, Qwen3-Next / Qwen3.5): the engine captures no CUDA graphs for it."""
    return "linear_attention" in (text_config(path).get("layer_types") or [])


def graphs_off(path: Path) -> bool:
    """Whether the engine captures no decode CUDA graphs for this checkpoint at all: a family
    whose forward reads host values a graph would fix (models/registry.py `no_graphs`:
    DeepSeek-V4's attention). Hybrid models' decode graphs take their state slots as inputs."""
    from moetier.models.registry import FAMILIES as REGISTRY
    from moetier.models.registry import supported_architectures

    supported_architectures()  # imports every family module, which registers it
    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    return any(REGISTRY[a].no_graphs for a in archs if a in REGISTRY)


def graphs_apply(path: Path) -> bool:
    """Whether decode steps of this checkpoint can replay as CUDA graphs (engine/graphs.py):
    a MoE kernel computes its experts and the engine captures graphs for it (`graphs_off`)."""
    return moe_kernels_apply(path) and not graphs_off(path)


def prefill_graphs_off(path: Path) -> bool:
    """Whether prefill runs eagerly for this checkpoint: no decode graphs, or recurrent state
    (prefill graphs have no state-slot inputs)."""
    return graphs_off(path) or recurrent_state(path)


def prefill_graphs_apply(path: Path) -> bool:
    """Whether a fresh prompt's prefill can replay as a CUDA graph (engine/prefill_graphs.py)."""
    return moe_kernels_apply(path) and not prefill_graphs_off(path)


def min_budget(path: Path, dtype_bytes: int = 4) -> str:
    """The smallest expert budget moetier accepts for this checkpoint: top-k slots, in bytes."""
    cfg = text_config(path)
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return f"{top_k(cfg) * 3 * cfg['hidden_size'] * inter * dtype_bytes}B"


_GROUPED_IN_INTERPRETER = """
from pathlib import Path
import moetier.kernels._grouped_ffn_triton as tri
from tests.models.parity import PROMPTS, check_parity
calls = []
real = tri.grouped_ffn_triton
def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
tri.grouped_ffn_triton = counting
check_parity(Path({path!r}), None, prompts=PROMPTS[:2], moe_grouped_kernel=True,
             moe_slot_kernel_max_pairs=0)
assert calls
print("ok")
"""


def check_grouped_kernel_in_interpreter(path: Path) -> None:
    """`check_parity` (every expert resident, two prompts) with the grouped Triton kernel itself
    computing every MoE call, in Triton's CPU interpreter (a fresh process: it is read at
    import). Skipped without Triton."""
    from tests.unit.test_expert_ffn import _run_in_interpreter

    _run_in_interpreter(_GROUPED_IN_INTERPRETER.format(path=str(path)))


def moetier_greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def check_parity(
    path: Path,
    expert_budget: Any,
    host_budget: Any = None,
    device: str = "cpu",
    prompts: list[list[int]] = PROMPTS,
    reference: Path | None = None,
    **llm_kwargs: Any,
) -> dict[str, float]:
    """Assert moetier == transformers token for token (and logits close); return offload stats.
    `reference`: the checkpoint transformers runs (default `path`; a quantized checkpoint's
    dequantized copy)."""
    ref = hf_model(reference or path)
    llm = LLM(
        str(path),
        expert_budget=expert_budget,
        host_budget=host_budget,
        device=device,
        dtype="float32",
        progress=False,
        **llm_kwargs,
    )
    got = moetier_greedy(llm, prompts)
    on_device = None
    for prompt, tokens in zip(prompts, got):
        want = hf_greedy(ref, prompt)
        if tokens != want and device != "cpu":
            # A near-tied choice can fall the other way on another device for transformers
            # too (DeepSeek-V4's tiny checkpoint, prompt [7, 8, 9], token 20 on an H100):
            # then transformers on the same device is the reference.
            on_device = on_device or hf_model(reference or path).to(device)
            want = hf_greedy(on_device, prompt)
        assert tokens == want, f"token mismatch for prompt {prompt}"
    for prompt in prompts:
        torch.testing.assert_close(
            llm.prompt_logits(prompt), hf_last_logits(ref, prompt), rtol=1e-4, atol=1e-4
        )
    llm.engine.runner.expert_cache.check_integrity()
    return llm.offload_stats()


TOKENIZER_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Mixture of experts models route each token to a few experts.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
]


def add_tokenizer(path: Path, vocab_size: int = 240) -> None:
    """Train a tiny byte-level BPE tokenizer (offline) and save it beside the checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
