"""Torch CPU threads: the one place that picks and applies them (LLM, generate, serve, bench).

A requested count is used as given. "auto" (None) takes the cores this process may run on less
one for each core's worth of other work, at least one thread: an OpenMP thread on a core another
process keeps busy makes every parallel region wait for it (2 cores, demo model, two busy
neighbours: README "Threads"). Other work is the larger of the 1-minute load average and the
tasks of other processes runnable right now (the load average lags a neighbour that just
started). OMP_NUM_THREADS set in the environment counts as a request: auto then leaves torch's
threads as they are. Auto only acts on CPU devices; on CUDA torch's threads are left alone unless
a count is requested. Imports torch only to apply a count (the CLI parses --threads without it).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from moetier.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SAMPLES = 5  # runnable-task samples; the smallest wins (a momentary blip is not load)
_SAMPLE_GAP_S = 0.01
PROC_LOADAVG = "/proc/loadavg"  # a module constant so tests can point it at a file


def check_threads(threads: object) -> int | None:
    """`threads` as an int >= 1, or None for auto; ConfigError for anything else."""
    if threads is None or (isinstance(threads, str) and threads.strip().lower() == "auto"):
        return None
    value: object = threads
    if isinstance(threads, str):
        try:
            value = int(threads.strip())
        except ValueError:
            value = threads
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"threads must be an integer >= 1 or 'auto' (torch CPU threads), got {threads!r}"
        )
    return value


def threads_arg(text: str) -> int | None:
    """argparse type of --threads: 'auto' (None) or an integer >= 1."""
    import argparse

    try:
        return check_threads(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or an integer >= 1, got {text!r}"
        ) from exc


THREADS_HELP = (
    "torch CPU threads: an integer >= 1, or auto (default: on a CPU device, the usable cores "
    "less the other work on the machine, at least 1; on CUDA, torch's choice)"
)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def load_average() -> float:
    """The 1-minute load average, or 0.0 where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def _own_running() -> int:
    """This process's threads in state R (running or runnable) now."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R":
            n += 1
    return max(n, 1)


def runnable_others() -> float:
    """Runnable tasks of other processes now (Linux /proc/loadavg's running count less this
    process's own), the smallest of a few samples 10 ms apart; 0.0 where /proc is absent."""
    best: float | None = None
    for i in range(_SAMPLES):
        try:
            with open(PROC_LOADAVG, encoding="ascii") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0.0
        others = max(0, running - _own_running())
        best = others if best is None else min(best, others)
        if best == 0:
            break
        if i + 1 < _SAMPLES:
            time.sleep(_SAMPLE_GAP_S)
    return float(best or 0)


def auto_threads(cores: int, load: float, others: float) -> int:
    """The auto rule: `cores` less the other work (the larger of the load average and the other
    runnable tasks now, rounded half up), at least 1."""
    busy = max(load, others)
    return max(1, min(cores, cores - int(busy + 0.5)))


def choose_threads(requested: object = None) -> int:
    """The thread count to use: `requested` if given (checked), else the auto rule on this
    machine now."""
    n = check_threads(requested)
    if n is not None:
        return n
    return auto_threads(usable_cores(), load_average(), runnable_others())


def apply_threads(n: int) -> None:
    """Set torch's intra-op threads to `n` (checked)."""
    import torch

    n_checked = check_threads(n)
    if n_checked is None:
        raise ConfigError("apply_threads needs a count; resolve 'auto' with choose_threads")
    if torch.get_num_threads() != n_checked:
        torch.set_num_threads(n_checked)


def configure_threads(requested: object, device: torch.device | str) -> int | None:
    """Apply the thread setting for an engine on `device`; returns the count set, or None when
    torch's threads were left alone: auto on CUDA, or auto with OMP_NUM_THREADS set in the
    environment (the user's choice, which torch already follows). Logged at info level."""
    n = check_threads(requested)
    device_type = device if isinstance(device, str) else device.type
    if n is None and device_type.split(":")[0] != "cpu":
        return None
    if n is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        log.info(
            "torch CPU threads: left at %d (auto, and OMP_NUM_THREADS=%s is set)",
            _torch_threads(),
            os.environ["OMP_NUM_THREADS"].strip(),
        )
        return None
    if n is None:
        cores, load, others = usable_cores(), load_average(), runnable_others()
        n = auto_threads(cores, load, others)
        log.info(
            "torch CPU threads: %d (auto: %d usable cores, load average %.2f, %d other "
            "runnable tasks now; threads=N / --threads N pins it)",
            n,
            cores,
            load,
            int(others),
        )
    else:
        log.info("torch CPU threads: %d (requested)", n)
    apply_threads(n)
    return n


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())
