"""GGUF files end to end on CUDA: the expert kernels read the file's blocks in place.

The tiny files of the CPU GGUF tests (tests/models/test_gguf.py, writers in
tests/models/gguf_files.py) run on CUDA with their experts in compressed slots that the Triton
kernels decode in registers (kernels/slot_layout.py): gpt-oss with MXFP4 experts (ggml type 39,
transcoded into moetier's Mxfp4Codec layout), a Qwen3-MoE Q4_K_M file (gate/up Q4_K, down
Q6_K) and a Gemma 4 Q4_K_M file (gate and up fused in ffn_gate_up_exps, gelu-tanh experts;
tests/models/gguf_gemma4_files.py), each at every expert resident and at the minimum budget
(top-k slots), on the slot kernel (CUDA's defaults: the grouped kernel above 128 pairs and for
waves, decode replayed as CUDA graphs) and on the grouped kernel alone.

References and tolerances are the CPU tests': transformers' float32 model holding gguf's
dequantization of the bytes written (Qwen3-MoE: transformers' own GGUF load; gpt-oss and Gemma
4: the HF model loaded with the writer's dequantized state), run on the CPU. float32 on CUDA:
greedy tokens equal the reference exactly and last-prompt logits are within rtol = atol = 1e-4;
as in tests/models/parity.py `check_parity` (test_gpu_parity.py), a token that differs is
checked against the same transformers model on CUDA (a near-tied choice may fall the other way
on another device for transformers too). bfloat16 (what CUDA runs by default) follows
test_gpu_parity.py `test_bf16_close_to_transformers_bf16`: logits no farther from the float32
reference than transformers' own bfloat16 logits are (x1.5 + 0.01 of the largest logit); greedy
agreement in bf16 is printed, not asserted (two correct bf16 paths may fork late).

Every test also shows the kernel path ran: the Triton entry points were called (counted), the
per-expert loop (which decodes each expert to dense) never was, and each MoE layer's slot
layout is the file's compressed format; decode replayed as CUDA graphs where every expert is
resident. Run on the GPU machine with `bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T

from moetier import LLM
from moetier.kernels.grouped_ffn import SLOT_KERNEL_MAX_PAIRS
from moetier.kernels.slot_layout import MXFP4, Q4_K, Q6_K
from tests.models.gguf_files import (
    NEW,
    Q4_K_M,
    Types,
    reference_model,
    slot_bytes,
    tiny_hf_model,
    transformers_gguf,
    write_gguf,
    write_gpt_oss_gguf,
)
from tests.models.gguf_gemma4_files import GEMMA4_K, tiny_gemma4_model, write_gemma4_gguf
from tests.models.parity import PROMPTS, hf_greedy, hf_last_logits, moetier_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# name -> (expert types, packing name, (gate/up, down) kernel format codes)
CASES: dict[str, tuple[Types, str, tuple[int, int]]] = {
    "gpt_oss-mxfp4": ((T.MXFP4,) * 3, "mxfp4", (MXFP4, MXFP4)),
    "qwen3_moe-q4_k_m": (Q4_K_M, "gguf-q4_k/gguf-q4_k/gguf-q6_k", (Q4_K, Q6_K)),
    # Gemma 4: gate and up fused in one GGUF tensor (ffn_gate_up_exps), gelu-tanh experts
    "gemma4-q4_k_m": (Q4_K_M, "gguf-q4_k/gguf-q4_k/gguf-q6_k", (Q4_K, Q6_K)),
}
PATHS: dict[str, dict[str, Any]] = {  # MoE compute path -> LLM switches
    # CUDA's defaults spelled out: the slot kernel up to 128 (token, expert) pairs (every call
    # of these prompts), the grouped one above and for waves; decode as CUDA graphs
    "slot": dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=SLOT_KERNEL_MAX_PAIRS),
    "grouped": dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=0, cuda_graphs=False),
}
RUNS = [("100%", "slot"), ("min", "slot"), ("100%", "grouped")]


@dataclass
class Case:
    path: Path
    ref: Any  # transformers' float32 model on the CPU
    experts: Types
    packing: str
    formats: tuple[int, int]
    tokens: list[list[int]]  # the reference's greedy tokens for PROMPTS
    logits: torch.Tensor  # the reference's last logits of PROMPTS[0]
    on_cuda: Any = None  # the reference on CUDA, made when a token differs

    def min_budget(self) -> str:
        """Top-k slots of the file's encoded experts (the CPU test's minimum), in bytes."""
        cfg = self.ref.config
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        top_k = getattr(cfg, "num_experts_per_tok", None) or cfg.top_k_experts  # Gemma 4's name
        return f"{top_k * slot_bytes(self.experts, cfg.hidden_size, inter)}B"


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """Each case's GGUF file, its reference and the reference's outputs (made on first use)."""
    root = tmp_path_factory.mktemp("gguf_gpu")

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> Case:
            experts, packing, formats = CASES[name]
            path = root / f"{name}.gguf"
            if name.startswith("gpt_oss"):
                model = tiny_hf_model("gpt_oss")
                ref = reference_model(model, write_gpt_oss_gguf(model, path, T.MXFP4, T.F32))
            elif name.startswith("gemma4"):
                model = tiny_gemma4_model(**GEMMA4_K)
                ref = reference_model(model, write_gemma4_gguf(model, path, (T.Q4_K, T.Q6_K)))
            else:
                write_gguf(tiny_hf_model("qwen3_moe"), path, Q4_K_M, T.F32)
                ref = transformers_gguf(path, moe_intermediate_size=256)
            tokens = [hf_greedy(ref, p, NEW) for p in PROMPTS]
            case = Case(
                path, ref, experts, packing, formats, tokens, hf_last_logits(ref, PROMPTS[0])
            )
            self[name] = case
            return case

    return Lazy()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of the Triton slot and grouped kernels' entry points and of the per-expert loop
    (a CUDA-graph replay launches the captured kernels without calling Python: captures count)."""
    import moetier.kernels._expert_ffn_triton as slot_tri
    import moetier.kernels._grouped_ffn_triton as grouped_tri
    from moetier.layers.moe import MoEBlock

    calls: Counter[str] = Counter()

    def counting(key: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(slot_tri, "expert_ffn_triton", counting("slot", slot_tri.expert_ffn_triton))
    grouped = counting("grouped", grouped_tri.grouped_ffn_triton)
    monkeypatch.setattr(grouped_tri, "grouped_ffn_triton", grouped)
    monkeypatch.setattr(MoEBlock, "_wave_loop", counting("loop", MoEBlock._wave_loop))
    return calls


def _llm(case: Case, budget: str, moe_path: str, dtype: str) -> LLM:
    return LLM(
        str(case.path),
        expert_budget=case.min_budget() if budget == "min" else budget,
        device="cuda",
        dtype=dtype,
        progress=False,
        **PATHS[moe_path],
    )


def _check_layout(llm: LLM, case: Case) -> None:
    """Every MoE layer's slots are the file's blocks as stored, read by the kernels in place."""
    runner = llm.engine.runner
    assert runner.expert_cache.packing.name == case.packing
    blocks = runner.model.moe_blocks()
    assert blocks
    for block in blocks:
        layout = block.slot_layout
        assert layout is not None and layout.compressed, block.layer
        assert (layout.gate_up_format, layout.down_format) == case.formats, block.layer


@pytest.mark.parametrize("budget,moe_path", RUNS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_fp32_parity_on_cuda(
    cases: dict[str, Case], kernel_calls: Counter[str], name: str, budget: str, moe_path: str
) -> None:
    case = cases[name]
    llm = _llm(case, budget, moe_path, "float32")
    _check_layout(llm, case)
    runner = llm.engine.runner
    if budget == "min":
        assert runner.tier_plan.device_slots == runner.top_k
    got = moetier_greedy(llm, PROMPTS, NEW)
    for prompt, tokens, want in zip(PROMPTS, got, case.tokens):
        if tokens != want:  # a near-tie may fall the other way on CUDA for transformers too
            case.on_cuda = case.on_cuda or copy.deepcopy(case.ref).to("cuda")
            want = hf_greedy(case.on_cuda, prompt, NEW)
        assert tokens == want, f"{name} {budget} {moe_path}: prompt {prompt}"
    torch.testing.assert_close(llm.prompt_logits(PROMPTS[0]), case.logits, rtol=1e-4, atol=1e-4)
    runner.expert_cache.check_integrity()
    # the kernels computed every MoE call: none took the per-expert loop
    assert kernel_calls["loop"] == 0, kernel_calls
    assert kernel_calls["slot"] + kernel_calls["grouped"] > 0, kernel_calls
    stats = llm.offload_stats()
    if moe_path == "grouped":
        assert kernel_calls["slot"] == 0 < kernel_calls["grouped"], kernel_calls
    elif budget == "100%":
        assert kernel_calls["slot"] > 0, kernel_calls
        assert runner.graphs is not None and not runner.graphs.failed
        assert runner.graphs.replays > 0 and stats["decode_graph_replays"] > 0
    if budget == "min":  # slots were refilled from the host tier
        assert stats["bytes_host_to_device"] > 0 and stats["evictions"] > 0, stats


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_bf16_close_to_reference_on_cuda(
    cases: dict[str, Case], kernel_calls: Counter[str], name: str
) -> None:
    """bf16 (CUDA's default dtype), experts resident, slot kernel and graphs: last logits no
    farther from the float32 reference than transformers' bf16 logits are (x1.5 + 0.01 of the
    largest logit), as test_gpu_parity.py's bf16 test; greedy agreement is printed."""
    case = cases[name]
    exact = copy.deepcopy(case.ref).to("cuda")
    ref = copy.deepcopy(case.ref).to(torch.bfloat16).to("cuda")
    llm = _llm(case, "100%", "slot", "bfloat16")
    _check_layout(llm, case)
    for prompt in PROMPTS:
        want = hf_last_logits(exact, prompt).float()
        ours, theirs = llm.prompt_logits(prompt).float(), hf_last_logits(ref, prompt).float()
        scale = want.abs().max().item()
        err, hf_err = ((x - want).abs().max().item() / scale for x in (ours, theirs))
        assert err <= 1.5 * hf_err + 0.01, f"bf16 logits: {err:.4f} from float32, HF's {hf_err:.4f}"
    got = moetier_greedy(llm, PROMPTS, NEW)
    want_tokens = [hf_greedy(ref, p, NEW) for p in PROMPTS]
    same = sum(a == b for g, w in zip(got, want_tokens) for a, b in zip(g, w))
    print(f"bf16 greedy agreement {name}: {same}/{NEW * len(PROMPTS)} tokens")
    assert kernel_calls["loop"] == 0 < kernel_calls["slot"], kernel_calls
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and not graphs.failed
