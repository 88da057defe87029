"""Locates routed-expert tensors in a checkpoint (per-expert or fused layout) and packs them.

An expert is packed into one flat buffer: gate_up [2I, D] (gate rows, then up rows) followed by
down [D, I], so one copy moves it between tiers. Three checkpoint layouts, each read by offset:
per-expert `experts.{e}.gate_proj/up_proj/down_proj` (or w1/w3/w2), fused `experts.gate_up_proj`
[E, 2I, D] + `experts.down_proj` [E, D, I], and fused transposed (Llama 4) [E, D, 2I] +
[E, I, D], whose rows are transposed while packing. Owns no caching and no device placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint

# Per-expert tensor names (gate, up, down) used by the supported families.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class ExpertShape:
    """Geometry of one routed expert: D hidden, I intermediate."""

    hidden: int
    intermediate: int

    @property
    def numel(self) -> int:
        return 3 * self.hidden * self.intermediate

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (gate_up [2I, D], down [D, I]) of a packed expert buffer."""
        d, i = self.hidden, self.intermediate
        return flat[: 2 * i * d].view(2 * i, d), flat[2 * i * d :].view(d, i)


@dataclass(frozen=True)
class _LayerSource:
    fused: bool
    names: tuple[str, ...]  # per-expert name templates with {e}, or (gate_up, down) fused names
    transposed: bool = False  # fused as [E, D, 2I] + [E, I, D] (the matmul's right operands)


def _fused_transposed(gate_up: tuple[int, ...], down: tuple[int, ...]) -> bool | None:
    """Which fused layout the shapes (without E) are: False for [2I, D] + [D, I], True for
    [D, 2I] + [I, D], None for neither. Never both: that would need I = 0."""
    (a, b), (c, d) = gate_up, down
    if a == 2 * d and b == c:
        return False
    if b == 2 * c and a == d:
        return True
    return None


class ExpertLayout:
    """Finds each MoE layer's routed experts in the checkpoint and reads one expert by offset."""

    def __init__(self, ckpt: Checkpoint, prefixes: dict[int, list[str]], num_experts: int) -> None:
        """`prefixes` maps an MoE layer index to candidate module prefixes, e.g.
        ["model.layers.3.block_sparse_moe", "model.layers.3.mlp"]."""
        self.ckpt = ckpt
        self.num_experts = num_experts
        self.sources: dict[int, _LayerSource] = {
            layer: self._find(layer, cands) for layer, cands in prefixes.items()
        }
        self.shape = self._infer_shape()

    def _find(self, layer: int, candidates: list[str]) -> _LayerSource:
        for prefix in candidates:
            base = f"{prefix}.experts"
            for gate_up in (f"{base}.gate_up_proj", f"{base}.gate_up_proj.weight"):
                down = gate_up.replace("gate_up_proj", "down_proj")
                if gate_up in self.ckpt and down in self.ckpt:
                    return _LayerSource(True, (gate_up, down), self._transposed(gate_up, down))
            for g, u, d in _PER_EXPERT_NAMES:
                names = tuple(f"{base}.{{e}}.{n}.weight" for n in (g, u, d))
                if names[0].format(e=0) in self.ckpt:
                    self._check_all_experts(layer, names)
                    return _LayerSource(False, names)
        raise CheckpointError(
            f"{self.ckpt.model_dir}: no routed-expert tensors for MoE layer {layer} (looked for "
            f"{candidates[0]}.experts.0.gate_proj.weight and {candidates[0]}.experts.gate_up_proj)"
        )

    def _transposed(self, gate_up: str, down: str) -> bool:
        shapes = [self.ckpt.info(n).shape for n in (gate_up, down)]
        layout = None
        if all(len(s) == 3 and s[0] == self.num_experts for s in shapes):
            layout = _fused_transposed(shapes[0][1:], shapes[1][1:])
        if layout is None:
            raise CheckpointError(
                f"{self.ckpt.model_dir}: fused experts {gate_up} {tuple(shapes[0])} and {down} "
                f"{tuple(shapes[1])} are neither [E, 2I, D] + [E, D, I] nor [E, D, 2I] + "
                f"[E, I, D] with E = {self.num_experts}"
            )
        return layout

    def _check_all_experts(self, layer: int, names: tuple[str, ...]) -> None:
        for e in range(self.num_experts):
            for n in names:
                if n.format(e=e) not in self.ckpt:
                    raise CheckpointError(
                        f"{self.ckpt.model_dir}: layer {layer} is missing tensor {n.format(e=e)}"
                    )

    def _infer_shape(self) -> ExpertShape:
        layer, src = next(iter(self.sources.items()))
        if src.fused:
            _, d, i = self.ckpt.info(src.names[1]).shape  # down: [E, D, I]
            if src.transposed:  # down: [E, I, D]
                d, i = i, d
            return ExpertShape(hidden=d, intermediate=i)
        i, d = self.ckpt.info(src.names[0].format(e=0)).shape
        return ExpertShape(hidden=d, intermediate=i)

    @property
    def layers(self) -> list[int]:
        return sorted(self.sources)

    def source_bytes(self, layer: int, expert: int) -> int:
        """Bytes read from disk for one expert in its checkpoint dtype."""
        src = self.sources[layer]
        if src.fused:
            return sum(self.ckpt.info(n).nbytes // self.num_experts for n in src.names)
        return sum(self.ckpt.info(n.format(e=expert)).nbytes for n in src.names)

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> int:
        """Read expert (layer, expert) into the packed CPU buffer `out`; return bytes read."""
        src = self.sources[layer]
        gate_up, down = self.shape.split(out)
        i = self.shape.intermediate
        if src.fused:
            parts = [
                self.ckpt.read(src.names[0], row=expert),
                self.ckpt.read(src.names[1], row=expert),
            ]
            if src.transposed:  # [D, 2I] -> [2I, D] and [I, D] -> [D, I]
                gate_up.copy_(parts[0].t())
                down.copy_(parts[1].t())
            else:
                gate_up.copy_(parts[0])
                down.copy_(parts[1])
        else:
            parts = [self.ckpt.read(n.format(e=expert)) for n in src.names]
            gate_up[:i].copy_(parts[0])
            gate_up[i:].copy_(parts[1])
            down.copy_(parts[2])
        return sum(p.numel() * p.element_size() for p in parts)
