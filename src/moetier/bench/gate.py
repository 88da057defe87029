"""`moetier bench gate`: the protocol's ship gate, candidate settings against baseline settings.

Owns the verdict rule and its report; the measurements come from latency.py. Both sides run
the same latency protocol on every (shape, seed) pair, alternating which side goes first. The
verdict is SHIP only when the candidate
  1. lowers exposed fetch time per token over all pairs together (sum), and is not higher
     than the baseline by more than the noise threshold in any pair (with `metric` "prefill",
     for a change to how prompts are run: the same on TTFT, the wait for the first token, of
     which a prompt's exposed fetch is part), and
  2. does not lower tokens/s by more than the noise threshold in any pair, and
  3. keeps on-demand misses the fastest service class: where either side prefetched, the
     exposed fetch per on-demand miss (a device miss: prefetched keys hit at use are hits, and
     waits on prefetches still in flight count against the candidate) is not higher than the
     baseline's by more than the noise threshold in any pair. Without prefetch on either side
     the rule does not apply and the table says so.
Every verdict, NO-SHIP included, is written as markdown and JSON under the results folder.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moetier.bench.latency import LatencySettings, run_latency
from moetier.bench.report import save_json

_BENCH_KEYS = {f.name for f in fields(LatencySettings)} - {"llm_kwargs", "budgets"}


@dataclass
class GateSettings:
    baseline: dict[str, Any]
    candidate: dict[str, Any]
    name: str | None = None
    shapes: list[str] = field(default_factory=lambda: ["tiny-qwen3", "tiny-deepseek-v2"])
    layers: int | None = None
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    weights_seed: int | None = None  # None: each seed generates its own synthetic weights
    expert_budget: str = "25%"
    input_len: int = 16
    output_len: int = 16
    batch_size: int = 1
    routing: str = "uniform"
    device: str = "auto"
    dtype: str = "auto"
    noise: float = 0.05
    metric: str = "decode"  # rule 1 on exposed fetch per decode token, or "prefill": on TTFT
    out_dir: str = "bench/results"
    progress: bool = True


def side_settings(g: GateSettings, kv: dict[str, Any], shape: str, seed: int) -> LatencySettings:
    """LatencySettings of one side: bench keys from k=v, everything else goes to LLM(...)."""
    kv = dict(kv)
    budget = str(kv.pop("expert_budget", g.expert_budget))
    bench = {k: kv.pop(k) for k in list(kv) if k in _BENCH_KEYS}
    base: dict[str, Any] = dict(
        synthetic=shape,
        layers=g.layers,
        budgets=["100%", budget],
        batch_size=g.batch_size,
        num_prompts=g.batch_size,
        input_len=g.input_len,
        output_len=g.output_len,
        seed=seed,
        weights_seed=g.weights_seed,
        routing=g.routing,
        device=g.device,
        dtype=g.dtype,
        progress=g.progress,
    )
    base.update(bench)
    return LatencySettings(**base, llm_kwargs=kv)


def _row(result: dict[str, Any]) -> dict[str, Any]:
    """The offloaded configuration of a side's result (the last one; 100% is the reference)."""
    return dict(result["configs"][-1])


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()[:60] or "gate"


# rule 1's measure per metric: (row key, name, unit)
METRICS = {
    "decode": ("exposed_fetch_ms_per_token", "exposed fetch", "ms/token"),
    "prefill": ("ttft_ms", "TTFT", "ms"),
}


def judge(
    pairs: list[dict[str, Any]], noise: float, metric: str = "decode"
) -> tuple[str, list[str]]:
    """SHIP or NO-SHIP, with the reasons a NO-SHIP failed (see module docstring)."""
    if metric not in METRICS:
        from moetier.errors import ConfigError

        raise ConfigError(f"gate metric {metric!r}: use one of {', '.join(METRICS)}")
    key, name, unit = METRICS[metric]
    reasons = []
    base_sum = sum(p["baseline"][key] for p in pairs)
    cand_sum = sum(p["candidate"][key] for p in pairs)
    if not cand_sum < base_sum:
        reasons.append(f"{name} not lower overall ({cand_sum:.3f} vs {base_sum:.3f} {unit} summed)")
    for p in pairs:
        b, c, tag = p["baseline"], p["candidate"], f"{p['shape']} seed {p['seed']}"
        if c[key] > b[key] * (1 + noise):
            reasons.append(f"{tag}: {name} higher beyond noise")
        if c["tokens_per_s"] < b["tokens_per_s"] * (1 - noise):
            reasons.append(f"{tag}: tokens/s lower beyond noise")
        wb, wc = miss_wait_ms(b), miss_wait_ms(c)
        if prefetched(p) and wb is not None and wc is not None and wc > wb * (1 + noise):
            reasons.append(
                f"{tag}: an on-demand miss waits longer beyond noise ({wc:.3f} vs {wb:.3f} ms)"
            )
    return ("SHIP" if not reasons else "NO-SHIP"), reasons


def prefetched(pair: dict[str, Any]) -> bool:
    return any(pair[side].get("prefetches_issued", 0) > 0 for side in ("baseline", "candidate"))


def miss_wait_ms(row: dict[str, Any]) -> float | None:
    """Exposed fetch per on-demand (device) miss, ms; None without misses."""
    misses = row.get("misses_per_token") or 0.0
    return row["exposed_fetch_ms_per_token"] / misses if misses > 0 else None


def gate_table(g: GateSettings, pairs: list[dict[str, Any]], verdict: str, why: list[str]) -> str:
    lines = [
        f"# ship gate: {verdict}",
        "",
        f"baseline: `{_kv(g.baseline)}`  candidate: `{_kv(g.candidate)}`",
        f"expert budget {g.expert_budget}, routing {g.routing}, batch {g.batch_size}, input "
        f"{g.input_len}, output {g.output_len}, device {g.device}, dtype {g.dtype}, noise "
        f"threshold {g.noise:.0%}, rule 1 on {METRICS[g.metric][1]}",
        "",
        "| shape | seed | exposed fetch ms/tok base | cand | ratio | tok/s base | cand | ratio "
        "| TPOT ms base | cand | TTFT ms base | cand | hit base | cand |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        b, c = p["baseline"], p["candidate"]
        eb, ec = b["exposed_fetch_ms_per_token"], c["exposed_fetch_ms_per_token"]
        tb, tc = b["tokens_per_s"], c["tokens_per_s"]
        lines.append(
            f"| {p['shape']} | {p['seed']} | {eb:.3f} | {ec:.3f} | {ec / eb if eb else 0:.2f} "
            f"| {tb:.1f} | {tc:.1f} | {tc / tb if tb else 0:.2f} | {b['tpot_ms']:.2f} "
            f"| {c['tpot_ms']:.2f} | {b['ttft_ms']:.1f} | {c['ttft_ms']:.1f} "
            f"| {b['device_hit_rate']:.3f} | {c['device_hit_rate']:.3f} |"
        )
    lines += ["", f"verdict: **{verdict}**"]
    lines += [f"- {r}" for r in why]
    if any(prefetched(p) for p in pairs):
        waits = ", ".join(
            f"{p['shape']} seed {p['seed']}: {_ms(miss_wait_ms(p['baseline']))} -> "
            f"{_ms(miss_wait_ms(p['candidate']))}"
            for p in pairs
        )
        lines.append(f"- exposed fetch per on-demand miss, ms (rule 3): {waits}")
    else:
        lines.append("- rule 3 (on-demand misses stay the fastest class): no prefetch here")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _kv(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items()) or "(defaults)"


def run_gate(g: GateSettings) -> tuple[str, str]:
    """Run every pair, write the table and JSON, return (markdown, verdict)."""
    pairs = []
    for shape in g.shapes:
        for i, seed in enumerate(g.seeds):
            sides = [("baseline", g.baseline), ("candidate", g.candidate)]
            if i % 2:
                sides.reverse()  # alternate who runs first: warm caches and clocks even out
            pair: dict[str, Any] = {"shape": shape, "seed": seed}
            for side, kv in sides:
                pair[side] = _row(run_latency(side_settings(g, kv, shape, seed)))
            pairs.append(pair)
    verdict, why = judge(pairs, g.noise, g.metric)
    text = gate_table(g, pairs, verdict, why)
    name = g.name or _slug(_kv(g.candidate))
    stem = Path(g.out_dir) / f"{dt.date.today().isoformat()}-gate-{name}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.md").write_text(text + "\n")
    record = {
        "verdict": verdict,
        "reasons": why,
        "settings": {k: v for k, v in vars(g).items()},
        "pairs": pairs,
    }
    save_json(f"{stem}.json", record)
    return text + f"\n\nwrote {stem}.md and .json", verdict
