"""Test-wide settings: offline hub, deterministic torch, quiet progress bars."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)  # tiny models: threads only add contention
