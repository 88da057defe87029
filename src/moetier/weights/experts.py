"""Locates routed-expert tensors in a checkpoint (per-expert or fused layout) and packs them.

An expert is packed into one flat buffer (weights/formats.py), so one copy moves it between
tiers. Three checkpoint layouts, each read by offset: per-expert
`experts.{e}.gate_proj/up_proj/down_proj` (or w1/w3/w2), fused `experts.gate_up_proj`
[E, 2I, D] + `experts.down_proj` [E, D, I], and fused transposed (Llama 4) [E, D, 2I] +
[E, I, D], whose rows are transposed while packing. Per-expert FP8 tensors (F8_E4M3 with a
`weight_scale_inv` per 128x128 block) are packed as stored and decoded where computed; so are
gpt-oss's fused MXFP4 experts (`gate_up_proj_blocks` [E, 2I, D/32, 16] + `gate_up_proj_scales`
[E, 2I, D/32], the same for down_proj, weights/mxfp4.py). gpt-oss interleaves gate and up in
the 2I dim (gate = even rows, up = odd rows, `interleaved`): packing de-interleaves them into
our gate-then-up order (MXFP4 rows of blocks and scales move as wholes). Owns no caching and
no device placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetier.errors import CheckpointError
from moetier.weights.checkpoint import Checkpoint
from moetier.weights.formats import (
    ExpertFormat,
    ExpertPacking,
    ExpertShape,
    Fp8BlockCodec,
    MatrixCodec,
)
from moetier.weights.mxfp4 import MXFP4

__all__ = ["ExpertLayout", "ExpertShape"]

# Per-expert tensor names (gate, up, down) used by the supported families.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _LayerSource:
    fused: bool
    names: tuple[str, ...]  # per-expert name templates with {e}, or (gate_up, down) fused names
    transposed: bool = False  # fused as [E, D, 2I] + [E, I, D] (the matmul's right operands)
    fp8: Fp8BlockCodec | None = None  # per-expert FP8 with block scales (`{name}_scale_inv`)
    mxfp4: bool = False  # fused MXFP4: `{name}_blocks` + `{name}_scales` (names without suffix)
    interleaved: bool = False  # fused gate_up alternates gate and up rows (gpt-oss)


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

    # Expert parallelism (parallel/): whether this rank owns (layer, expert), set by the model
    # runner from its placement; None = every expert is this process's. The tiers hold,
    # preload and count only the experts it owns.
    owns: Callable[[int, int], bool] | None = None

    def __init__(
        self,
        ckpt: Checkpoint,
        prefixes: dict[int, list[str]],
        num_experts: int,
        fp8_block: tuple[int, int] = (128, 128),
        interleaved: bool = False,
    ) -> None:
        """`prefixes` maps an MoE layer index to candidate module prefixes, e.g.
        ["model.layers.3.block_sparse_moe", "model.layers.3.mlp"]; `fp8_block` is the FP8
        scale block ([rows, cols], the config's `quantization_config.weight_block_size`);
        `interleaved`: fused gate_up tensors alternate gate and up rows (the family says so:
        gpt-oss; shapes cannot tell)."""
        self.ckpt = ckpt
        self.num_experts = num_experts
        self.fp8_block = fp8_block
        self.interleaved = interleaved
        self.sources: dict[int, _LayerSource] = {
            layer: self._find(layer, cands) for layer, cands in prefixes.items()
        }
        self.shape = self._infer_shape()

    def owned(self) -> list[tuple[int, int]]:
        """(layer, expert) of every routed expert this process serves, layer-major."""
        owns = self.owns
        return [
            (la, e)
            for la in self.layers
            for e in range(self.num_experts)
            if owns is None or owns(la, e)
        ]

    @property
    def total(self) -> int:
        """Routed experts this process serves (every expert unless expert parallelism)."""
        if self.owns is None:
            return len(self.layers) * self.num_experts
        return len(self.owned())

    def _find(self, layer: int, candidates: list[str]) -> _LayerSource:
        for prefix in candidates:
            base = f"{prefix}.experts"
            gate_up, down = f"{base}.gate_up_proj", f"{base}.down_proj"
            if f"{gate_up}_blocks" in self.ckpt:
                self._check_mxfp4(gate_up, down)
                return _LayerSource(True, (gate_up, down), mxfp4=True, interleaved=self.interleaved)
            for gate_up in (f"{base}.gate_up_proj", f"{base}.gate_up_proj.weight"):
                down = gate_up.replace("gate_up_proj", "down_proj")
                if gate_up in self.ckpt and down in self.ckpt:
                    self._check_float(gate_up, down)
                    return _LayerSource(
                        True,
                        (gate_up, down),
                        self._transposed(gate_up, down),
                        interleaved=self.interleaved,
                    )
            for g, u, d in _PER_EXPERT_NAMES:
                names = tuple(f"{base}.{{e}}.{n}.weight" for n in (g, u, d))
                if names[0].format(e=0) in self.ckpt:
                    self._check_all_experts(layer, names)
                    return _LayerSource(False, names, fp8=self._fp8(names))
        raise CheckpointError(
            f"{self.ckpt.model_dir}: no routed-expert tensors for MoE layer {layer} (looked for "
            f"{candidates[0]}.experts.0.gate_proj.weight and {candidates[0]}.experts.gate_up_proj)"
        )

    def _check_float(self, *names: str) -> None:
        for n in names:
            dtype = self.ckpt.info(n).dtype
            if dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{self.ckpt.model_dir}: expert tensor {n} is stored as {dtype}; fused "
                    f"experts are read in float32, bfloat16 or float16 only"
                )

    def _check_mxfp4(self, gate_up: str, down: str) -> None:
        """Blocks [E, R, C/32, 16] and scales [E, R, C/32], uint8, for gate_up (R = 2I,
        C = D) and down (R = D, C = I), all four present."""
        dims: list[tuple[int, int]] = []
        for base in (gate_up, down):
            blocks, scales = f"{base}_blocks", f"{base}_scales"
            for n in (blocks, scales):
                if n not in self.ckpt:
                    raise CheckpointError(
                        f"{self.ckpt.model_dir}: MXFP4 experts need {n} beside {gate_up}_blocks"
                    )
                if self.ckpt.info(n).dtype != torch.uint8:
                    raise CheckpointError(
                        f"{self.ckpt.model_dir}: MXFP4 tensor {n} is stored as "
                        f"{self.ckpt.info(n).dtype}; blocks and E8M0 scales are uint8"
                    )
            b, sc = self.ckpt.info(blocks).shape, self.ckpt.info(scales).shape
            if len(b) != 4 or b[0] != self.num_experts or b[3] != 16 or tuple(sc) != b[:3]:
                raise CheckpointError(
                    f"{self.ckpt.model_dir}: MXFP4 tensors {blocks} {tuple(b)} and {scales} "
                    f"{tuple(sc)} are not [E, rows, cols/32, 16] and [E, rows, cols/32] with "
                    f"E = {self.num_experts}"
                )
            dims.append((b[1], b[2] * 32))
        (gu_rows, gu_cols), (d_rows, d_cols) = dims
        if gu_rows != 2 * d_cols or gu_cols != d_rows:
            raise CheckpointError(
                f"{self.ckpt.model_dir}: MXFP4 experts {gate_up} [{gu_rows}, {gu_cols}] and "
                f"{down} [{d_rows}, {d_cols}] are not [2I, D] and [D, I]"
            )

    def _fp8(self, names: tuple[str, ...]) -> Fp8BlockCodec | None:
        """The FP8 codec when the per-expert tensors are F8_E4M3 with block scales; None when
        they are float; an error for any other storage."""
        dtypes = {self.ckpt.info(n.format(e=0)).dtype for n in names}
        if dtypes <= set(_FLOAT_DTYPES):
            return None
        if dtypes != {torch.float8_e4m3fn}:
            raise CheckpointError(
                f"{self.ckpt.model_dir}: expert tensors {names[0].format(e=0)} (and its up/down) "
                f"are stored as {sorted(map(str, dtypes))}; experts are read in float32, "
                f"bfloat16, float16 or FP8 e4m3 with block scales"
            )
        for n in names:
            scale = n.format(e=0) + "_scale_inv"
            if scale not in self.ckpt:
                raise CheckpointError(
                    f"{self.ckpt.model_dir}: FP8 expert tensor {n.format(e=0)} has no "
                    f"{scale}; moetier reads FP8 with 128x128 block scales (weight_scale_inv)"
                )
        return Fp8BlockCodec(self.fp8_block)

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
        if src.mxfp4:  # down blocks: [E, D, I/32, 16]
            _, d, groups, _ = self.ckpt.info(src.names[1] + "_blocks").shape
            return ExpertShape(hidden=d, intermediate=groups * 32)
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

    def packing(self, dtype: torch.dtype) -> ExpertPacking:
        """Each layer's packed format with `dtype` the compute dtype (dense layers' storage)."""
        formats = {}
        for layer, src in self.sources.items():
            codecs: tuple[MatrixCodec, MatrixCodec, MatrixCodec] | None = None
            if src.fp8 is not None:
                codecs = (src.fp8, src.fp8, src.fp8)
            elif src.mxfp4:
                codecs = (MXFP4, MXFP4, MXFP4)
            formats[layer] = ExpertFormat(self.shape, dtype, codecs)
        return ExpertPacking(formats)

    def source_bytes(self, layer: int, expert: int) -> int:
        """Bytes read from disk for one expert as the checkpoint stores it."""
        src = self.sources[layer]
        if src.mxfp4:
            names = [n + part for n in src.names for part in ("_blocks", "_scales")]
            return sum(self.ckpt.info(n).nbytes // self.num_experts for n in names)
        if src.fused:
            return sum(self.ckpt.info(n).nbytes // self.num_experts for n in src.names)
        names = [n.format(e=expert) for n in src.names]
        if src.fp8 is not None:
            names += [n + "_scale_inv" for n in names]
        return sum(self.ckpt.info(n).nbytes for n in names)

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> int:
        """Read expert (layer, expert) into the packed CPU buffer `out` (a row of the
        packing's storage dtype); return bytes read."""
        src = self.sources[layer]
        if src.fp8 is not None:
            return self._read_fp8(src, src.fp8, expert, out)
        if src.mxfp4:
            return self._read_mxfp4(src, expert, out)
        gate_up, down = self.shape.split(out)
        i = self.shape.intermediate
        if src.fused:
            parts = [
                self.ckpt.read(src.names[0], row=expert),
                self.ckpt.read(src.names[1], row=expert),
            ]
            # [D, 2I] -> [2I, D] and [I, D] -> [D, I]
            gu, dn = (parts[0].t(), parts[1].t()) if src.transposed else parts
            if src.interleaved:  # gate = even rows, up = odd rows
                gate_up[:i].copy_(gu[0::2])
                gate_up[i:].copy_(gu[1::2])
            else:
                gate_up.copy_(gu)
            down.copy_(dn)
        else:
            parts = [self.ckpt.read(n.format(e=expert)) for n in src.names]
            gate_up[:i].copy_(parts[0])
            gate_up[i:].copy_(parts[1])
            down.copy_(parts[2])
        return sum(p.numel() * p.element_size() for p in parts)

    def _read_fp8(
        self, src: _LayerSource, codec: Fp8BlockCodec, expert: int, out: torch.Tensor
    ) -> int:
        fmt = ExpertFormat(self.shape, torch.bfloat16, (codec, codec, codec))
        total = 0
        for name, part in zip(src.names, fmt.parts(out)):
            values = self.ckpt.read(name.format(e=expert))
            scales = self.ckpt.read(name.format(e=expert) + "_scale_inv")
            try:
                part.copy_(codec.encode(values, scales))
            except ValueError as exc:
                raise CheckpointError(
                    f"{self.ckpt.model_dir}: {name.format(e=expert)}_scale_inv: {exc}"
                ) from None
            total += values.numel() + scales.numel() * scales.element_size()
        return total

    def _read_mxfp4(self, src: _LayerSource, expert: int, out: torch.Tensor) -> int:
        """Pack one MXFP4 expert as stored: gate (even rows of gate_up's blocks and scales),
        up (odd rows), down, each encoded by the MXFP4 codec."""
        fmt = ExpertFormat(self.shape, torch.bfloat16, (MXFP4, MXFP4, MXFP4))
        read = [
            (self.ckpt.read(n + "_blocks", row=expert), self.ckpt.read(n + "_scales", row=expert))
            for n in src.names
        ]
        (gu_blocks, gu_scales), down = read
        i = self.shape.intermediate
        if src.interleaved:
            mats = [(gu_blocks[0::2], gu_scales[0::2]), (gu_blocks[1::2], gu_scales[1::2])]
        else:
            mats = [(gu_blocks[:i], gu_scales[:i]), (gu_blocks[i:], gu_scales[i:])]
        for (blocks, scales), part in zip([*mats, down], fmt.parts(out)):
            part.copy_(MXFP4.encode(blocks, scales))
        return sum(b.numel() + s.numel() for b, s in read)
