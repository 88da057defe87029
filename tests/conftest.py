"""Test-wide settings: offline hub, deterministic torch, quiet progress bars."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# A set OMP_NUM_THREADS makes LLM's auto threads leave torch's count alone (moetier/threads.py):
# the suite's one thread below holds for every engine the tests build.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)  # tiny models: threads only add contention
