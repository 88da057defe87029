"""Device time of decode steps: kernel time and launches per step from torch.profiler (CUDA).

Owns only the reading of profiler events; the caller decides which steps run inside it. The
profiled steps are a separate pass from the timed one, so profiling never distorts timings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceTime:
    kernel_ms_per_step: float  # sum of CUDA kernel durations / steps (copies excluded)
    launches_per_step: float  # CUDA kernels per step
    copy_ms_per_step: float  # memcpy/memset time on the device / steps (any stream)
    steps: int
    # the kernels that took the most device time: (name, ms per step, launches per step)
    top_kernels: tuple[tuple[str, float, float], ...] = ()


def profile_steps(run_step: Callable[[], None], steps: int, top: int = 15) -> DeviceTime:
    """Run `run_step` `steps` times under torch.profiler and sum its device activity."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    kernel_us = copy_us = 0.0
    kernels = 0
    by_name: dict[str, list[float]] = {}
    for evt in prof.events():
        # user annotations are ranges projected onto the device timeline, not device work
        if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        us = float(evt.time_range.elapsed_us())
        if evt.name.startswith(("Memcpy", "Memset")):
            copy_us += us
        else:
            kernel_us += us
            kernels += 1
            acc = by_name.setdefault(evt.name[:120], [0.0, 0.0])
            acc[0] += us
            acc[1] += 1
    n = max(steps, 1)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    tops = tuple((name, us / 1e3 / n, cnt / n) for name, (us, cnt) in ranked)
    return DeviceTime(kernel_us / 1e3 / n, kernels / n, copy_us / 1e3 / n, steps, tops)
