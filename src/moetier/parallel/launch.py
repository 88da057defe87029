"""Starting an expert-parallel group: rank 0 (the process that runs the engine) either starts
the other ranks itself, one `python -m moetier.parallel.worker` process each on this host, or
joins a group a launcher such as torchrun started (env:// rendezvous: MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), which is how the same code runs across hosts.

torch.distributed is the engine: NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetier.config import EngineConfig
from moetier.errors import ConfigError
from moetier.parallel.group import (
    ExpertParallel,
    ExpertParallelError,
    checkpoint_fingerprint,
    torchrun_rank,
)
from moetier.parallel.placement import make_placement

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """The config a rank runs with: on CUDA its own GPU (LOCAL_RANK), with the decode graphs
    off (the collective is not captured yet); on the CPU, with threads left to auto, an equal
    share of the usable cores (the ranks of one host compute at the same time)."""
    from moetier.engine.model_runner import resolve_device
    from moetier.threads import usable_cores

    device = resolve_device(config.device)
    if device.type != "cuda":
        if config.threads is not None or os.environ.get("OMP_NUM_THREADS", "").strip():
            return config
        share = max(1, usable_cores() // config.parallel.expert_parallel_size)
        return replace(config, threads=share)
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"--expert-parallel-size asks for GPU {local_rank} on this host, which has {count}: "
            f"lower --expert-parallel-size to at most {count}"
        )
    torch.cuda.set_device(local_rank)
    return replace(config, device=f"cuda:{local_rank}", cuda_graphs=False)


def backend_of(config: EngineConfig) -> str:
    from moetier.engine.model_runner import resolve_device

    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


class Workers:
    """Rank 0's handle on the group: the processes it started (none under torchrun)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        self.procs = procs
        self.logs = logs

    def why_dead(self) -> str | None:
        """A started rank that has exited: its number, exit code and its log's last lines."""
        for rank, (proc, path) in enumerate(zip(self.procs, self.logs), start=1):
            code = proc.poll()
            if code is not None:
                return f"rank {rank} exited with code {code}: {_tail(path)}"
        return None

    def check_ready(self, parallel: ExpertParallel | None) -> None:
        """Every rank built its engine part: one gather; a rank that failed is named."""
        if parallel is None:
            return
        try:
            parallel.gather("ready")
        except ExpertParallelError as exc:
            deadline = time.monotonic() + 10.0  # let a failing rank's exit be seen
            while self.why_dead() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            why = self.why_dead()
            self.stop()
            raise ExpertParallelError(why or str(exc)) from exc

    def stop(self, timeout_s: float = 10.0) -> None:
        """The started ranks exit (they were sent "stop", or the group broke); any still
        running after `timeout_s` is killed."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def _check_experts(model: str, size: int) -> None:
    """More ranks than experts in a layer is an error before any rank starts (a config that
    cannot be read is left to the engine's load, which names the file)."""
    from moetier.engine.model_runner import load_model_config
    from moetier.layers.moe import moe_config

    try:
        experts = moe_config(load_model_config(Path(model)))[0]
    except Exception:  # noqa: BLE001 - reported by the load, with the file's name
        return
    if size > experts:
        raise ConfigError(
            f"--expert-parallel-size {size} is more ranks than the model has experts in a "
            f"layer ({experts}): use at most {experts}"
        )


def start_group(config: EngineConfig) -> Workers | None:
    """Rank 0: join (or start) the group `config.parallel` asks for; None for one rank."""
    size = config.parallel.expert_parallel_size
    if size == 1:
        return None
    _check_experts(config.model, size)
    timeout = timedelta(seconds=config.parallel.timeout_s)
    backend = backend_of(config)
    if dist.is_initialized():
        raise ConfigError("an expert-parallel group is already running in this process")
    if torchrun_rank() is not None:  # a launcher started every rank: env:// rendezvous
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != size:
            raise ConfigError(
                f"--expert-parallel-size {size} but the launcher started {world} ranks "
                "(WORLD_SIZE): pass the same number to both"
            )
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return Workers([], [])
    port = _free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="moetier-ep-"))
    payload = pickle.dumps(config)
    procs, logs = [], []
    for rank in range(1, size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            MOETIER_EP_RANK=str(rank),
        )
        path = log_dir / f"rank{rank}.log"
        with open(path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moetier.parallel.worker"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
        procs.append(proc)
        logs.append(path)
    workers = Workers(procs, logs)
    done: list[BaseException | None] = []

    def init() -> None:
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=size,
                timeout=timeout,
            )
            done.append(None)
        except BaseException as exc:  # reported by the waiting thread
            done.append(exc)

    thread = threading.Thread(target=init, name="moetier-ep-init", daemon=True)
    thread.start()
    deadline = time.monotonic() + config.parallel.timeout_s
    while not done:
        why = workers.why_dead()
        if why is not None or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise ExpertParallelError(
                f"the expert-parallel group of {size} ranks did not start: "
                f"{why or f'no answer within {config.parallel.timeout_s:g} s'}"
            )
        thread.join(0.05)
    if done[0] is not None:
        workers.stop(0.0)
        raise ExpertParallelError(f"the expert-parallel group did not start: {done[0]}")
    log.info("expert parallelism: %d ranks (%s), logs of ranks 1+ in %s", size, backend, log_dir)
    return workers


def join(config: EngineConfig, layers: list[int], num_experts: int) -> ExpertParallel | None:
    """Every rank, once the model's MoE layers are known: the placement and the checkpoint
    check (ranks given different checkpoints stop at start-up)."""
    if config.parallel.expert_parallel_size == 1 or not dist.is_initialized():
        return None
    par = config.parallel
    if dist.get_world_size() > num_experts:
        raise ConfigError(
            f"--expert-parallel-size {dist.get_world_size()} is more ranks than the model has "
            f"experts in a layer ({num_experts}): use at most {num_experts}"
        )
    placement = make_placement(
        par.expert_placement, layers, num_experts, dist.get_world_size(), par.placement_trace
    )
    group = ExpertParallel(placement, par.timeout_s)
    mine = checkpoint_fingerprint(config.model)
    prints: list[Any] = [None] * group.world
    group._collective(dist.all_gather_object, prints, mine)
    other = [r for r, p in enumerate(prints) if p != prints[0]]
    if other:
        raise ExpertParallelError(
            f"ranks {other} loaded a different checkpoint than rank 0 ({config.model}): every "
            "rank must read the same files"
        )
    counts = placement.counts()
    log.info(
        "rank %d of %d owns %d of %d routed experts (%s placement)",
        group.rank, group.world, counts[group.rank], sum(counts), placement.name,
    )  # fmt: skip
    return group
