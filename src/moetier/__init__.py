"""moetier: run Mixture-of-Experts language models with experts tiered over device, RAM and disk."""

import os as _os

# OpenMP threads that spin while waiting for work make CPU inference collapse when another
# process holds a core (measured on 2 cores with the demo model and a busy neighbour: 0.39 tok/s
# spinning vs 6.4 passive, 6.7-7.0 on one thread). Passive waiting costs little on a quiet
# machine. It must be set before torch loads its OpenMP runtime; a value the user set wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from moetier.config import EngineConfig  # noqa: E402
from moetier.core import SamplingParams, StructuredOutput  # noqa: E402
from moetier.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "EngineConfig"]
__version__ = "0.1.0"
