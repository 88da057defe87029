"""A rank other than 0: build the model's rank part, then run every step rank 0 sends.

Started by rank 0 (`python -m moetier.parallel.worker`, the pickled EngineConfig on stdin,
env:// rendezvous variables in the environment) or, under torchrun, by `run_worker` from the
CLI. It exits on "stop", or when the group fails (rank 0 gone, or the timeout).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from moetier.config import EngineConfig
from moetier.parallel.group import ExpertParallelError

log = logging.getLogger("moetier.parallel.worker")


def run_worker(config: EngineConfig) -> int:
    """Join the group (env://), build this rank's engine part and follow rank 0; the exit code."""
    from moetier.engine.model_runner import ModelRunner
    from moetier.parallel.launch import backend_of, rank_config
    from moetier.threads import configure_threads

    if not dist.is_initialized():
        dist.init_process_group(
            backend_of(config),
            init_method="env://",
            timeout=timedelta(seconds=config.parallel.timeout_s),
        )
    rank = dist.get_rank()
    config = rank_config(config, int(os.environ.get("LOCAL_RANK", rank)))
    configure_threads(config.threads, config.device)
    runner = ModelRunner(config)
    parallel = runner.parallel
    assert parallel is not None
    try:
        parallel.gather("ready")
        while True:
            message = parallel.receive()
            kind = message[0]
            if kind == "stop":
                return 0
            if kind == "step":
                runner.run_remote(message[1])
            elif kind == "stats":
                parallel.gather(runner.rank_stats())
    except ExpertParallelError as exc:
        log.error("rank %d stops: %s", rank, exc)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = pickle.loads(sys.stdin.buffer.read())
    with torch.inference_mode():
        code = run_worker(config)
    sys.exit(code)


if __name__ == "__main__":
    main()
