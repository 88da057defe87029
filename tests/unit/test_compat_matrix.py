"""scripts/compat_matrix.py reads junit cases per family and path and never claims a pass it
did not see: failures, skips and missing results show as such."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites>
<testsuite name="pytest" tests="10" timestamp="2026-12-04T20:00:00">
<testcase classname="tests.models.test_family_parity" name="test_parity_budgets[gemma4-None]"/>
<testcase classname="tests.models.test_family_parity" name="test_parity_budgets[gemma4-50%]">
<failure message="token mismatch">x</failure></testcase>
<testcase classname="tests.models.test_slot_kernel" name="test_slot_kernel_parity[gemma4-min]"/>
<testcase classname="tests.models.test_slot_kernel" name="test_slot_kernel_parity[mixtral-min]">
<skipped message="s"/></testcase>
<testcase classname="tests.models.test_family_parity" name="test_unparametrized"/>
<testcase classname="tests.models.test_gguf" name="test_gguf_parity[qwen3_moe-q4_k_m-min]"/>
<testcase classname="tests.models.test_gguf" name="test_gguf_parity[mixtral-q8_0-50%]"/>
<testcase classname="tests.models.test_gguf" name="test_gguf_parity[mixtral-q4_k_m-50%]">
<failure message="token mismatch">x</failure></testcase>
<testcase classname="tests.models.test_gguf_hybrid" name="test_hybrid_parity[qwen3_next-100%]"/>
<testcase classname="tests.models.test_gguf_deepseek"
 name="test_glm_deepseek_parity[deepseek_v3-min]"/>
<testcase classname="tests.models.test_gguf_deepseek"
 name="test_glm_deepseek_parity[deepseek_v3-100%]"><failure message="m">x</failure></testcase>
<testcase classname="tests.models.test_other" name="test_hybrid_parity[olmoe-100%]"/>
<testcase classname="tests.server.test_family_parity_served"
 name="test_served_concurrent_preempted_equal_transformers[qwen3_5_moe]"/>
<testcase classname="tests.server.test_family_parity_served"
 name="test_served_concurrent_preempted_equal_transformers[gpt_oss]">
<failure message="token mismatch">x</failure></testcase>
<testcase classname="tests.parallel.test_expert_parallel"
 name="test_expert_parallel_equals_transformers[qwen3_moe-2-50%]"/>
<testcase classname="tests.parallel.test_expert_parallel"
 name="test_expert_parallel_equals_transformers[deepseek_v2-2-None]"/>
<testcase classname="tests.parallel.test_expert_parallel"
 name="test_expert_parallel_equals_transformers[deepseek_v2-3-None]">
<failure message="token mismatch">x</failure></testcase>
</testsuite></testsuites>"""


def _script() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "scripts" / "compat_matrix.py"
    spec = importlib.util.spec_from_file_location("compat_matrix", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_cells_from_junit(tmp_path: Path) -> None:
    cm = _script()
    (tmp_path / "cpu.xml").write_text(JUNIT)
    cases, stamp = cm.read_junit(tmp_path / "cpu.xml")
    assert stamp == "2026-12-04T20:00:00" and len(cases) == 16
    full, half, low, _, _, _, slot, _, gguf, served, parallel = cm.CPU_COLUMNS
    assert cm.cell(cases, full, "gemma4", ("", True, False)) == "pass"
    assert cm.cell(cases, half, "gemma4", ("", True, False)) == "**FAIL** 1/1"
    assert cm.cell(cases, low, "gemma4", ("", True, False)) == "not run"
    assert cm.cell(cases, slot, "gemma4", ("", True, False)) == "pass (loop fallback)"
    assert cm.cell(cases, slot, "mixtral", ("", False, False)) == "skipped"
    # every format and budget
    assert cm.cell(cases, gguf, "qwen3_moe", ("", False, False)) == "pass"
    assert cm.cell(cases, gguf, "mixtral", ("", False, False)) == "**FAIL** 1/2"
    # the GGUF column's other modules and functions count; the same function elsewhere does not
    assert cm.cell(cases, gguf, "qwen3_next", ("", False, False)) == "pass"
    assert cm.cell(cases, gguf, "deepseek_v3", ("", False, False)) == "**FAIL** 1/2"
    assert cm.cell(cases, gguf, "olmoe", ("", False, False)) == "not run"
    assert cm.cell(cases, served, "qwen3_5_moe", ("", False, False)) == "pass"
    assert cm.cell(cases, served, "gpt_oss", ("", False, False)) == "**FAIL** 1/1"
    assert cm.cell(cases, served, "mixtral", ("", False, False)) == "not run"
    # expert parallelism: every rank count and budget of the family
    assert cm.cell(cases, parallel, "qwen3_moe", ("", False, False)) == "pass"
    assert cm.cell(cases, parallel, "deepseek_v2", ("", False, False)) == "**FAIL** 1/2"
    graphs = next(c for c in cm.GPU_COLUMNS if c.graphs)
    gpu = [cm.Case(graphs.module, graphs.function, "deepseek_v4", "", "pass")]
    assert cm.cell(gpu, graphs, "deepseek_v4", ("", False, True)) == "pass (graphs off: eager)"
    assert cm.cell(gpu, graphs, "deepseek_v4", ("", False, False)) == "pass"


def test_cpu_suite_runs_every_column_module() -> None:
    cm = _script()
    root = Path(cm.ROOT)
    for column in cm.CPU_COLUMNS:
        modules = (column.module,) if isinstance(column.module, str) else column.module
        for module in modules:
            path = module.replace(".", "/") + ".py"
            assert (root / path).is_file(), path
            assert any(path == s or path.startswith(s.rstrip("/") + "/") for s in cm.CPU_SUITE)
