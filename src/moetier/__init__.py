"""moetier: run Mixture-of-Experts language models with experts tiered over device, RAM and disk."""

from moetier.config import EngineConfig
from moetier.core import SamplingParams
from moetier.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"
