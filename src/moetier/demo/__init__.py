"""The built-in demo MoE model: SmolLM2-135M-Instruct upcycled to a 16-expert top-2 Mixtral.

Import `ensure_demo_model` from `moetier.demo.builder`; this package imports nothing heavy.
Variants (more experts, other top-k, perturbed experts) are `variants.DemoSpec`s; `tracing`
records an unperturbed variant's real-text routing from the dense model; `cli` holds
`moetier build-demo | record-trace | replay`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ensure_demo_model"]


def ensure_demo_model(*args: Any, **kwargs: Any) -> Any:
    """See moetier.demo.builder.ensure_demo_model (imported lazily: torch and transformers)."""
    from moetier.demo.builder import ensure_demo_model as build

    return build(*args, **kwargs)
