"""Write docs/compatibility.md from test evidence: per family x path, what passed.

Reads a junit XML of the CPU suite (`pytest <CPU_SUITE> -m "not gpu" --junitxml=...`: the
family parity modules, the served parity and expert parallelism), or runs that suite itself
when none is given, and optionally a junit XML of the GPU suite (`pytest tests/gpu -m gpu
--junitxml=...`, run on a GPU machine; --gpu-name names it). Every cell comes from test cases
of one family (the parametrization id's first part is the family's key in
tests/models/families.py); a column nobody ran says "not run". Never hand-edit the output.

    python scripts/compat_matrix.py                       # runs the CPU suite, writes the doc
    python scripts/compat_matrix.py --junit cpu.xml --commit abc1234 --gpu-junit gpu.xml
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Column:
    """One matrix column: the test cases (module(s), function(s), optional id suffix) it counts."""

    label: str
    module: str | tuple[str, ...]  # dotted test module(s), as junit's classname
    function: str | tuple[str, ...]  # a test function, or several that each cover some families
    suffix: str | None = None  # the parametrization id after the family ("None", "50%", ...)
    kernel: bool = False  # a MoE kernel path: a gelu family passes on the loop fallback
    graphs: bool = False  # a CUDA-graph path: a family without graphs passes eagerly


CPU_COLUMNS = (
    Column("100% resident", "tests.models.test_family_parity", "test_parity_budgets", "None"),
    Column("50% budget", "tests.models.test_family_parity", "test_parity_budgets", "50%"),
    Column("min budget", "tests.models.test_family_parity", "test_parity_budgets", "min"),
    Column(
        "disk tier (host < routed)",
        "tests.models.test_family_parity",
        "test_parity_host_tier_below_routed_bytes",
    ),
    Column("fused layout", "tests.models.test_family_parity", "test_parity_fused_layout"),
    Column(
        "grouped kernel path",
        "tests.models.test_grouped_moe",
        "test_grouped_kernel_parity",
        kernel=True,
    ),
    Column(
        "slot kernel path", "tests.models.test_slot_kernel", "test_slot_kernel_parity", kernel=True
    ),
    Column("prefetch", "tests.models.test_prefetch_parity", "test_parity_with_same_index_prefetch"),
    # GGUF files at 100% and the minimum budget (Q4_K_M, Q8_0, ... experts; gpt-oss's MXFP4;
    # the hybrids', GLM's, DeepSeek's, Gemma 4's and Llama 4's as llama.cpp's converter writes them)
    Column(
        "GGUF file",
        (
            "tests.models.test_gguf",
            "tests.models.test_gguf_hybrid",
            "tests.models.test_gguf_deepseek",
            "tests.models.test_gguf_olmoe",
            "tests.models.test_gguf_gemma4",
            "tests.models.test_gguf_llama4",
        ),
        (
            "test_gguf_parity",
            "test_gpt_oss_parity",
            "test_hybrid_parity",
            "test_glm_deepseek_parity",
            "test_olmoe_gguf_parity",
            "test_gemma4_gguf_parity",
            "test_llama4_gguf_parity",
        ),
    ),
    # `moetier serve` at a 50% budget: concurrent completions, chunked prefill, preemption
    Column(
        "server (concurrent, preempted)",
        "tests.server.test_family_parity_served",
        "test_served_concurrent_preempted_equal_transformers",
    ),
    # expert parallelism over 2 (and for three families 3) gloo ranks, one budget a family
    Column(
        "expert parallel (2-3 ranks)",
        "tests.parallel.test_expert_parallel",
        "test_expert_parallel_equals_transformers",
    ),
)
# The CPU suite: every module a CPU column reads (run_cpu_suite runs these).
CPU_SUITE = (
    "tests/models",
    "tests/server/test_family_parity_served.py",
    "tests/parallel/test_expert_parallel.py",
)
GPU_COLUMNS = (
    Column("GPU fp32 parity", "tests.gpu.test_gpu_parity", "test_fp32_parity_on_cuda"),
    Column("GPU disk tier", "tests.gpu.test_gpu_parity", "test_fp32_parity_with_disk_tier_on_cuda"),
    Column("GPU bf16 ~ HF", "tests.gpu.test_gpu_parity", "test_bf16_close_to_transformers_bf16"),
    Column(
        "GPU grouped kernel",
        "tests.gpu.test_gpu_grouped",
        "test_grouped_kernel_parity_every_budget",
        kernel=True,
    ),
    Column(
        "GPU CUDA graphs",
        "tests.gpu.test_gpu_graphs",
        "test_graph_decode_parity_with_transformers",
        kernel=True,
        graphs=True,
    ),
)


@dataclass(frozen=True)
class Case:
    module: str
    function: str
    family: str
    suffix: str  # the id after the family, "" when the family is the whole id
    outcome: str  # "pass", "fail", "skip"


def read_junit(path: Path) -> tuple[list[Case], str]:
    """The parametrized test cases of a junit XML, and the run's timestamp (ISO, as written)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    stamp = next((s.get("timestamp", "") for s in suites if s.get("timestamp")), "")
    cases = []
    for tc in root.iter("testcase"):
        name = tc.get("name", "")
        if "[" not in name:
            continue
        function, ident = name.split("[", 1)
        family, _, suffix = ident.rstrip("]").partition("-")
        if tc.find("failure") is not None or tc.find("error") is not None:
            outcome = "fail"
        elif tc.find("skipped") is not None:
            outcome = "skip"
        else:
            outcome = "pass"
        cases.append(Case(tc.get("classname", ""), function, family, suffix, outcome))
    return cases, stamp


def cell(cases: list[Case], column: Column, family: str, facts: tuple[str, bool, bool]) -> str:
    _, loop_only, no_graphs = facts
    modules = (column.module,) if isinstance(column.module, str) else column.module
    functions = (column.function,) if isinstance(column.function, str) else column.function
    mine = [
        c
        for c in cases
        if c.family == family
        and c.module in modules
        and c.function in functions
        and (column.suffix is None or c.suffix == column.suffix)
    ]
    if not mine:
        return "not run"
    failed = sum(c.outcome == "fail" for c in mine)
    passed = sum(c.outcome == "pass" for c in mine)
    if failed:
        return f"**FAIL** {failed}/{len(mine)}"
    if not passed:
        return "skipped"
    text = (
        "pass"
        if passed == len(mine)
        else f"pass {passed}/{len(mine)} ({len(mine) - passed} skipped)"
    )
    if column.graphs and no_graphs:
        return f"{text} (graphs off: eager)"
    return f"{text} (loop fallback)" if column.kernel and loop_only else text


# The configs' activations whose experts the MoE kernels compute (kernels/expert_ffn.py).
KERNEL_ACTS = ("silu", "gelu_pytorch_tanh")


def family_facts() -> dict[str, tuple[str, bool, bool]]:
    """Family key -> (HF model_type, whether only the per-expert loop computes its experts,
    whether the engine keeps CUDA graphs off for it: `Family.no_graphs`; hybrid families'
    decode graphs take their recurrent-state slots as inputs)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from tests.models.families import FAMILIES
    from transformers import AutoConfig

    from moetier.models.registry import FAMILIES as ENGINE_FAMILIES
    from moetier.models.registry import supported_architectures

    supported_architectures()  # loads the family modules
    graphless = {f.name for f in ENGINE_FAMILIES.values() if f.no_graphs is not None}
    facts = {}
    for key, fam in FAMILIES.items():
        cfg = AutoConfig.for_model(fam.model_type, **{**fam.tiny, **fam.main})
        act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
        no_graphs = key in graphless  # the recipes are keyed by family name
        facts[key] = (fam.model_type, act not in KERNEL_ACTS, no_graphs)
    return facts


def table(
    cases: list[Case], columns: tuple[Column, ...], facts: dict[str, tuple[str, bool, bool]]
) -> str:
    head = "| family | " + " | ".join(c.label for c in columns) + " |"
    rule = "|" + "---|" * (len(columns) + 1)
    rows = [
        f"| {key} (`{mtype}`) | " + " | ".join(cell(cases, c, key, fact) for c in columns) + " |"
        for key, fact in sorted(facts.items())
        for mtype in [fact[0]]
    ]
    return "\n".join([head, rule, *rows])


def git_commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def run_cpu_suite(junit: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", *CPU_SUITE, "-m", "not gpu"]
    subprocess.run([*cmd, f"--junitxml={junit}", "-p", "no:cacheprovider"], cwd=ROOT, env=env)


def render(
    cpu: tuple[list[Case], str, str],
    gpu: tuple[list[Case], str, str] | None,
    gpu_name: str = "GPU",
) -> str:
    facts = family_facts()
    cpu_cases, cpu_stamp, cpu_commit = cpu
    lines = [
        "# Compatibility matrix",
        "",
        "Generated by `scripts/compat_matrix.py` from junit test results; do not edit by hand.",
        "A cell is `pass` only where every test case of that family and path passed; `not run`",
        "means no result for it was given. Every case runs a tiny random checkpoint of the",
        "family's recipe (tests/models/families.py); in-process (every column but the server's)",
        "it compares greedy tokens (32 new tokens, three prompts) and last-position logits with",
        "transformers.",
        "`(loop fallback)`: the MoE kernels compute silu-gated experts (gpt-oss's and",
        "DeepSeek-V4's clamped SwiGLUs included) and Gemma 4's gelu_pytorch_tanh ones only, so",
        "this family's experts ran on the per-expert loop (and its decode eagerly, not as CUDA",
        "graphs) with that switch on.",
        "`(graphs off: eager)`: the engine keeps CUDA graphs off for this family (attention",
        "sized on the host), so its graph case ran eagerly.",
        "`server (concurrent, preempted)`: one `moetier serve` per family at a 50% expert budget",
        "(tests/server/test_family_parity_served.py); concurrent greedy completions of mixed",
        "prompt lengths, on a KV pool too small for them all (the server must report preemptions)",
        "and a step budget below the longest prompt (its prefill is chunked), return exactly",
        "transformers' tokens for each prompt alone, and nothing is left running or holding KV",
        "blocks.",
        "`expert parallel (2-3 ranks)`: `LLM(..., expert_parallel_size=N)` over gloo on the CPU",
        "(tests/parallel/test_expert_parallel.py): 2 ranks at one budget a family (100%, 50% and",
        "each rank's minimum in turn), 3 ranks for three families; greedy tokens and one prompt's",
        "logits equal transformers, each rank holding exactly its round-robin experts.",
        "",
        f'## CPU (`pytest {" ".join(CPU_SUITE)} -m "not gpu"`): '
        f"{cpu_stamp or 'time not recorded'}, commit {cpu_commit}",
        "",
        table(cpu_cases, CPU_COLUMNS, facts),
        "",
    ]
    if gpu is None:
        lines += ["## GPU (`pytest tests/gpu -m gpu`): not run", ""]
        lines += [table([], GPU_COLUMNS, facts), ""]
    else:
        gpu_cases, gpu_stamp, gpu_commit = gpu
        lines += [
            f"## {gpu_name} (`pytest tests/gpu -m gpu`): {gpu_stamp or 'time not recorded'}, "
            f"commit {gpu_commit}",
            "",
            table(gpu_cases, GPU_COLUMNS, facts),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", type=Path, help="CPU suite junit XML (default: run the suite)")
    ap.add_argument("--commit", help="commit the --junit run tested (default: HEAD now)")
    ap.add_argument("--gpu-junit", type=Path, help="GPU suite junit XML")
    ap.add_argument("--gpu-name", default="GPU", help="the device the GPU suite ran on")
    ap.add_argument("--gpu-commit", default="not recorded", help="commit the GPU run tested")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    args = ap.parse_args(argv)
    commit = args.commit or git_commit()
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "cpu.xml"
        run_cpu_suite(junit)
    cases, stamp = read_junit(junit)
    if not cases:
        raise SystemExit(f"{junit}: no parametrized test cases; is it a CPU suite junit?")
    gpu = None
    if args.gpu_junit is not None:
        gpu_cases, gpu_stamp = read_junit(args.gpu_junit)
        gpu = (gpu_cases, gpu_stamp, args.gpu_commit)
    args.out.write_text(render((cases, stamp, commit), gpu, args.gpu_name))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
