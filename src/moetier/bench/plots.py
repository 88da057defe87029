"""PNG plots of a latency result: TPOT against expert budget, and where each step's time goes.

Owns drawing only (matplotlib, Agg backend, imported lazily: a machine without matplotlib
runs the bench and plots later with `moetier bench plot RESULT.json`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _by_routing(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for cfg in result["configs"]:
        groups.setdefault(str(cfg.get("routing", "model")), []).append(cfg)
    for cfgs in groups.values():
        cfgs.sort(key=lambda c: c["budget_fraction"])
    return groups


def _val(cfg: dict[str, Any], key: str) -> float:
    v = cfg.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def write_plots(result: dict[str, Any], out_dir: str | Path, stem: str) -> list[Path]:
    """Write `<stem>-tpot.png` and `<stem>-breakdown.png` into `out_dir`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = result["settings"]
    title = (
        f"{s['shape']} ({s['model_num_layers']} layers), {s['device_name']}, "
        f"batch {s['batch_size']}, {s['dtype']}"
    )
    groups = _by_routing(result)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (routing, cfgs) in enumerate(groups.items()):
        x = [100 * c["budget_fraction"] for c in cfgs]
        color = f"C{i}"
        ax.plot(
            x,
            [_val(c, "tpot_ms") for c in cfgs],
            "o-",
            color=color,
            label=f"moetier TPOT, {routing}",
        )
        ax.plot(
            x,
            [_val(c, "bound_tpot_ms") for c in cfgs],
            "s--",
            color=color,
            alpha=0.6,
            label=f"bound (Belady + all-resident busy), {routing}",
        )
    for j, base in enumerate(result.get("baselines", [])):
        if base.get("skipped") or base.get("tpot_ms") is None:
            continue
        ax.axhline(
            base["tpot_ms"],
            color=f"C{len(groups) + j}",
            linestyle=":",
            label=f"{base['name']} TPOT",
        )
    ax.set_xlabel("expert budget (% of routed-expert bytes on the device)")
    ax.set_ylabel("ms per output token")
    ys = [
        _val(c, key)
        for cfgs in groups.values()
        for c in cfgs
        for key in ("tpot_ms", "bound_tpot_ms")
        if _val(c, key) > 0
    ]
    if ys and max(ys) / min(ys) > 10:  # offloaded configs can be 10-100x the floor
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tpot_path = out / f"{stem}-tpot.png"
    fig.savefig(tpot_path, dpi=120)
    plt.close(fig)

    cfgs = [c for group in groups.values() for c in group]
    labels = [f"{c['budget']}\n{str(c.get('routing', ''))[:12]}" for c in cfgs]
    exposed = [_val(c, "exposed_fetch_ms_per_token") for c in cfgs]
    if s["device_type"] == "cuda":
        busy = [_val(c, "gpu_busy_ms") for c in cfgs]
    else:  # CPU: busy is the whole step, which already contains the exposed fetch
        busy = [max(_val(c, "tpot_ms") - e, 0.0) for c, e in zip(cfgs, exposed)]
    other = [max(_val(c, "tpot_ms") - b - e, 0.0) for c, b, e in zip(cfgs, busy, exposed)]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(cfgs) + 2), 4.5))
    pos = list(range(len(cfgs)))
    ax.bar(
        pos,
        busy,
        label="device busy (kernels)" if s["device_type"] == "cuda" else "compute (CPU step)",
    )
    ax.bar(pos, exposed, bottom=busy, label="exposed fetch")
    ax.bar(pos, other, bottom=[b + e for b, e in zip(busy, exposed)], label="other host time")
    ax.set_xticks(pos, labels, fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    bar_path = out / f"{stem}-breakdown.png"
    fig.savefig(bar_path, dpi=120)
    plt.close(fig)
    return [tpot_path, bar_path]
