"""Gemma 4 specifics beyond the cross-family suite: the recipe exercises the sliding window and
the soft cap (HF's own tokens change without them), the router's hand-over to MoEBlock survives
a predictor calling other layers' routers and the bench swapping the gates, chunked prefill
keeps the window, the released multimodal form (Gemma4ForConditionalGeneration) runs its
language model, and unsupported Gemma 4 variants are refused clearly. The gelu_pytorch_tanh
experts run on the expert kernels (kernels/expert_ffn.py GELU_TANH): their math bit-equal to
the per-expert loop in bfloat16, and the Triton kernels themselves (Triton's interpreter) give
transformers' tokens with every expert resident and offloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetier import LLM
from moetier.errors import UnsupportedModelError
from moetier.kernels.expert_ffn import GELU_TANH, expert_ffn_reference
from moetier.layers.gemma4_router import Gemma4Router
from moetier.models.gemma4 import Gemma4MoE
from tests.models.families import FAMILIES
from tests.models.parity import (
    NEW_TOKENS,
    PROMPTS,
    check_parity,
    hf_greedy,
    hf_last_logits,
    hf_model,
    min_budget,
    moetier_greedy,
    randomize,
)
from tests.models.test_prefetch_parity import waves_budget
from tests.unit.test_expert_ffn import _run_in_interpreter, loop_output, selection_case

GEMMA = FAMILIES["gemma4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return GEMMA.checkpoint(tmp_path_factory.mktemp("gemma4"))


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of `src` (weights linked) with config.json keys changed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_recipe_exercises_window_and_soft_cap(ckpt: Path, tmp_path: Path) -> None:
    # Parity on the recipe means something only if HF depends on what we mirror: the window
    # changes tokens; the cap (monotonic) changes logits only, which parity compares too. (The
    # layer scalars, buffers HF leaves at 1, are randomized by the harness.)
    ref = hf_model(ckpt)
    wide = hf_model(_with_config(ckpt, tmp_path / "wide", sliding_window=4096))
    assert [hf_greedy(wide, p) for p in PROMPTS] != [hf_greedy(ref, p) for p in PROMPTS]
    uncapped = hf_model(_with_config(ckpt, tmp_path / "uncapped", final_logit_softcapping=None))
    capped = hf_last_logits(ref, PROMPTS[0])
    assert (capped - hf_last_logits(uncapped, PROMPTS[0])).abs().max() > 0.1  # >> parity's 1e-4


def test_parity_with_gate_lookahead(ckpt: Path) -> None:
    # The lookahead calls the next layer's router while this layer's routing is held.
    stats = check_parity(ckpt, waves_budget(ckpt), prefetch="gate-lookahead")
    assert stats["prefetches_issued"] > 0


def test_parity_with_chunked_prefill(ckpt: Path) -> None:
    # Prefill chunks of 4 tokens: each later chunk's window reaches into the cached tokens.
    check_parity(ckpt, "50%", max_num_batched_tokens=4)


def test_bench_routing_override_runs_and_undoes(ckpt: Path) -> None:
    from moetier.bench.routing_override import UniformRouting, install

    llm = LLM(str(ckpt), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    before = moetier_greedy(llm, PROMPTS[:1])
    undo = install(llm.engine.runner.model.moe_blocks(), UniformRouting(8, 2, seed=0))
    assert len(moetier_greedy(llm, PROMPTS[:1])[0]) == NEW_TOKENS
    undo()
    assert moetier_greedy(llm, PROMPTS[:1]) == before


@pytest.mark.parametrize(
    "change, what",
    [
        (dict(hidden_size_per_layer_input=8), "per-layer embeddings"),
        (dict(num_kv_shared_layers=2), "KV sharing"),
        (dict(enable_moe_block=False), "a dense Gemma 4"),
    ],
)
def test_unsupported_variants_are_refused(
    ckpt: Path, tmp_path: Path, change: dict, what: str
) -> None:
    path = _with_config(ckpt, tmp_path / "variant", **change)
    with pytest.raises(UnsupportedModelError, match=what):
        LLM(str(path), device="cpu", dtype="float32", progress=False)


def test_multimodal_wrapper_runs_its_language_model(tmp_path: Path) -> None:
    # The released checkpoints are Gemma4ForConditionalGeneration: tensors under
    # model.language_model.*, the text settings in text_config (towers left out here).
    from transformers import AutoConfig, Gemma4Config, Gemma4ForConditionalGeneration

    text = AutoConfig.for_model("gemma4_text", **{**GEMMA.tiny, **GEMMA.main})
    config = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).float()
    randomize(model)
    model.save_pretrained(tmp_path / "wrapper")
    path = tmp_path / "wrapper"
    assert check_parity(path, None)["total_experts"] == GEMMA.routed_experts
    assert check_parity(path, min_budget(path))["disk_reads"] > 0


def test_kernel_math_equals_the_loop_bitwise_bf16() -> None:
    """The kernels' reference (ExpertMath GELU_TANH, adds in ascending expert order) computes
    Gemma4MoE's per-expert loop (ACT2FN gelu_pytorch_tanh) with the same roundings: bit-equal
    in bfloat16 on experts whose dot products are exact. Another activation takes the loop."""
    d, i, e, k = 64, 32, 8, 2
    block = Gemma4MoE(0, Gemma4Router(d, e, k, 1e-6), "gelu_pytorch_tanh").to(torch.bfloat16)
    assert block.kernel_act == GELU_TANH and not block.topk_sum
    x, gate_up, down, pool, experts, w = selection_case(24, k, d, i, e, torch.bfloat16, 2.0)
    want = loop_output(block, x, gate_up, down, experts, w)
    got = expert_ffn_reference(x, pool, experts, w, i, math=block.expert_math())
    assert torch.equal(got, want)
    block.slot_kernel_max_pairs, block.grouped_kernel = 1 << 20, True
    assert block.slot_kernel_max_pairs > 0 and block.grouped_kernel
    other = Gemma4MoE(0, Gemma4Router(d, e, k, 1e-6), "gelu")
    other.slot_kernel_max_pairs, other.grouped_kernel = 1 << 20, True
    assert other.kernel_act is None
    assert other.slot_kernel_max_pairs == 0 and not other.grouped_kernel


_KERNELS_IN_INTERPRETER = """
from pathlib import Path
import moetier.kernels._expert_ffn_triton as slot
import moetier.kernels._grouped_ffn_triton as grouped
from tests.models.parity import PROMPTS, check_parity
kernel, budget = {kernel!r}, {budget!r}
mod, name = (slot, "expert_ffn_triton") if kernel == "slot" else (grouped, "grouped_ffn_triton")
calls = []
real = getattr(mod, name)
def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
setattr(mod, name, counting)
kw = (dict(moe_slot_kernel_max_pairs=1 << 20, moe_grouped_kernel=False) if kernel == "slot"
      else dict(moe_slot_kernel_max_pairs=0, moe_grouped_kernel=True))
stats = check_parity(Path({path!r}), budget, prompts=PROMPTS[:2], **kw)
assert calls
assert (stats["resident_lookups"] > 0) == (budget is None), stats
print("ok")
"""


# each kernel once and each budget once (the budget changes which slots the calls read, not the
# kernels' code; both kernels at both budgets cost ~2 min of CI in the interpreter)
@pytest.mark.parametrize(("kernel", "budget"), [("slot", None), ("grouped", "50%")])
def test_experts_on_the_triton_kernels_in_interpreter(
    ckpt: Path, kernel: str, budget: str | None
) -> None:
    # the Triton kernels themselves compute every MoE call (GELU_TANH: gelu in float32, its
    # tanh the interpreter's): transformers' tokens, every expert resident or offloaded
    _run_in_interpreter(
        _KERNELS_IN_INTERPRETER.format(path=str(ckpt), kernel=kernel, budget=budget)
    )


def test_device_cache_parity(ckpt: Path) -> None:
    # the kernels compute Gemma 4's experts, so the device cache takes it (it refuses a model
    # whose experts take the loop): every call resolved and filled by tensor ops, evicting
    stats = check_parity(
        ckpt, "50%", host_budget="100%", moe_grouped_kernel=True, moe_slot_kernel_max_pairs=16,
        device_cache=True,
    )  # fmt: skip
    assert stats["device_hits"] > 0 and stats["host_hits"] > 0 and stats["evictions"] > 0
    assert stats["moe_calls_host_decode"] == 0 and stats["moe_calls_device_decode"] > 0
