"""Reads a GGUF file as a moetier checkpoint: HF config, non-expert tensors, experts as stored.

A GGUF file (llama.cpp) carries the model's config as metadata, its tokenizer and chat template,
and every tensor under llama.cpp's names (`token_embd`, `blk.N.attn_q`, ...), most of them
block-quantized. `open_gguf` turns it into what the engine loads from a safetensors directory:
the HF config (transformers' GGUF mapping where it has one, completed here), a checkpoint whose
`read(name)` gives non-expert tensors under the HF names, dequantized to float32 at load, and a
`GGUFExpertLayout` whose experts (`blk.N.ffn_{gate,up,down}_exps`, [E, rows, cols] with each
expert's blocks contiguous) are read by offset and kept in their stored block type
(weights/gguf_quants.py), decoded only where they are computed; MXFP4 experts are rearranged
per expert as they are read into the layout of gpt-oss's safetensors MXFP4 experts (same bytes).
The file is memory mapped and read by offset, never whole.

Architectures: qwen3moe (Qwen3-MoE), qwen2moe (Qwen2-MoE, shared experts `ffn_*_shexp`), llama
with experts (Mixtral) and gpt-oss (gpt-oss-20b/120b: attention sinks and biases, a biased
router, expert biases `ffn_{gate,up,down}_exps.bias`; the config built in weights/gguf_gpt_oss.py
from the metadata keys llama.cpp reads, with what it fixes for the architecture rather than
stores), qwen35moe (Qwen3.5/3.6-MoE's language model) and qwen3next (Qwen3-Next): Gated
DeltaNet hybrids, their config and the inverse of llama.cpp's converter on their tensors in
weights/gguf_hybrid.py.
glm4moe (GLM-4.5/4.6) and deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2) are read through
weights/gguf_deepseek.py: config from the metadata, names of their own, and the tensors
llama.cpp's converter split (MLA's kv_b_proj) put back together. olmoe (OLMoE-1B-7B): tensors
renamed only, its config from the metadata in weights/gguf_olmoe.py. gemma4 (Gemma 4 MoE text,
Gemma-4-26B-A4B) through weights/gguf_gemma4.py: config from the metadata, names of its own; its
experts' gate and up fused in `blk.N.ffn_gate_up_exps`. llama4 (Llama 4 text, Llama-4-Scout /
Maverick) through weights/gguf_llama4.py: config from the metadata and what llama.cpp fixes
(NoPE and chunked layers, temperature tuning), llama3 rope read back from `rope_freqs`, names
of its own; q/k rows are read as stored (not permuted for llama4).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetier.errors import CheckpointError
from moetier.weights import gguf_deepseek, gguf_gemma4, gguf_gpt_oss, gguf_llama4, gguf_olmoe
from moetier.weights.experts import ExpertLayout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, MatrixCodec
from moetier.weights.gguf_hybrid import HYBRID_ARCHS, Derived, hybrid_config, hybrid_tensors
from moetier.weights.gguf_names import GLOBAL_NAMES
from moetier.weights.gguf_quants import GGUF_CODECS, GGUF_TRANSCODED, codec_for, ggml_type_name

__all__ = [
    "GGUFCheckpoint",
    "GGUFExpertLayout",
    "GGUFModel",
    "SUPPORTED_ARCHS",
    "gguf_architecture",
    "is_gguf",
    "open_gguf",
]

# GGUF architecture -> the HF architecture (models/registry.py) its tensors load into.
SUPPORTED_ARCHS = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "llama": "MixtralForCausalLM",  # llama.cpp writes Mixtral as llama with experts
    "gpt-oss": "GptOssForCausalLM",
    **HYBRID_ARCHS,  # qwen35moe, qwen3next: weights/gguf_hybrid.py
    **gguf_deepseek.ARCHS,  # glm4moe, deepseek2: weights/gguf_deepseek.py
    **gguf_olmoe.ARCHS,  # olmoe: weights/gguf_olmoe.py
    **gguf_gemma4.ARCHS,  # gemma4 (Gemma 4 MoE text): weights/gguf_gemma4.py
    **gguf_llama4.ARCHS,  # llama4 (Llama 4 text): weights/gguf_llama4.py
}

# blk.N.<gguf leaf> -> model.layers.N.<HF leaf> (.weight or .bias follows both)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# blk.N.<gguf leaf>.<suffix> -> model.layers.N.<HF name> (gpt-oss: HF names without a suffix)
_BLOCK_TENSORS = {
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
# model.layers.N.<HF name> <- two GGUF tensors interleaved along the last dim: gpt-oss's expert
# gate_up bias [E, 2I] (gate = even columns, up = odd), which llama.cpp's converter splits
_INTERLEAVED = {"mlp.experts.gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias")}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def is_gguf(path: str | Path) -> bool:
    """Whether a model path names a GGUF file (by its suffix)."""
    return str(path).lower().endswith(".gguf")


def gguf_architecture(path: str | Path) -> str:
    """`general.architecture` of a GGUF file, read from its header alone (token tables are
    left unread); "" where the header cannot be read (opening the file says why)."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(path))
    except Exception:  # struct, numpy and value errors of a truncated or foreign file
        return ""
    return str(metadata.get("general.architecture", ""))


@dataclass(frozen=True)
class _Tensor:
    """One GGUF tensor: where its bytes lie and how they are stored."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order (outermost first): [rows, cols], [E, rows, cols]
    offset: int  # absolute byte offset in the file
    nbytes: int
    data: Any  # the reader's memory-mapped numpy view (read lazily)


class _GGUFFile:
    """The parsed header of a GGUF file: metadata and tensor locations (memory mapped)."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise CheckpointError(
                f"{path}: no such file; pass a .gguf file or a Hugging Face model directory"
            )
        from gguf import GGUFReader

        self.path = path
        size = path.stat().st_size
        try:
            reader = GGUFReader(path, "r")
        except Exception as exc:  # the reader raises ValueError, struct/numpy errors, ...
            raise CheckpointError(
                f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); the file is "
                f"truncated or not GGUF — re-download it"
            ) from None
        self.fields: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("tokenizer.ggml.") and len(field.types) > 1:
                continue  # token tables (arrays): the tokenizer reads them itself
            try:
                self.fields[key] = field.contents()
            except (ValueError, IndexError, TypeError):
                continue
        self.tensors: dict[str, _Tensor] = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise CheckpointError(
                    f"{path}: tensor {t.name} ends at byte {end} but the file has {size} bytes; "
                    f"the file is truncated — re-download it"
                )
            self.tensors[t.name] = _Tensor(
                t.name, int(t.tensor_type), shape, int(t.data_offset), int(t.n_bytes), t.data
            )
        self.arch = str(self.fields.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.fields:
            raise CheckpointError(f"{self.path}: metadata key {full} is missing")
        return self.fields[full]

    def vocab_size(self) -> int:
        """`vocab_size`, else the embedding's rows (llama.cpp writes the key only sometimes)."""
        vocab = self.get("vocab_size")
        return int(vocab if vocab is not None else self.tensors["token_embd.weight"].shape[0])

    def head_dim(self, hidden: int, heads: int) -> int:
        """The attention head size (`attention.key_length`, else hidden / heads); a
        CheckpointError where `value_length` states another (these architectures have one)."""
        head_dim = int(self.get("attention.key_length", hidden // heads))
        value_length = int(self.get("attention.value_length", head_dim))
        if value_length != head_dim:
            raise CheckpointError(
                f"{self.path}: {self.arch}.attention.key_length {head_dim} and value_length "
                f"{value_length} differ; {self.arch} attention has one head size"
            )
        return head_dim


class _Reader:
    """Positional reads from one file (a file descriptor shared by threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU uint8 tensor `out` from the file at `offset`."""
        view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
        fd, done, total = self.fd(), 0, out.numel()
        while done < total:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"{self.path}: unexpected end of file at byte {offset + done}"
                )
            done += n

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation of the llama arch (rotary halves interleaved per
    head), as transformers does when it loads a llama GGUF."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFCheckpoint:
    """The non-expert tensors of a GGUF file under HF names, dequantized to float32 on read
    (what weights/loader.py needs of a `Checkpoint`: `in`, `read`, `model_dir`)."""

    def __init__(self, file: _GGUFFile, config: Any) -> None:
        self.file = file
        self.model_dir = file.path
        self.io = _Reader(file.path)
        self._heads = (0, 0)  # llama's q/k heads (un-permuted); gemma4's vary per layer
        if file.arch == "llama":
            self._heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.names: dict[str, str] = {}  # HF name -> GGUF name
        for name in file.tensors:
            hf = _hf_name(name)
            if hf is not None:
                self.names[hf] = name
        self.pairs: dict[str, tuple[str, str]] = {}  # HF name -> GGUF names interleaved
        for layer in range(int(config.num_hidden_layers)):
            for hf, parts in _INTERLEAVED.items():
                names = tuple(f"blk.{layer}.{part}" for part in parts)
                if all(n in file.tensors for n in names):
                    self.pairs[f"model.layers.{layer}.{hf}"] = names  # type: ignore[assignment]
        # HF name -> GGUF tensors and the inverse of the converter's change to them: the
        # hybrids' (weights/gguf_hybrid.py), deepseek2's split kv_b_proj (gguf_deepseek.py)
        self.derived: dict[str, Derived] = {}
        if file.arch in HYBRID_ARCHS:
            self.derived = hybrid_tensors(file, config)
        elif file.arch in gguf_deepseek.ARCHS:  # names of their own
            self.names = gguf_deepseek.hf_names(file, int(config.num_hidden_layers))
            self.derived = {
                name: Derived(parts, combine)
                for name, (parts, combine) in gguf_deepseek.assembled(file, config).items()
            }
        elif file.arch in gguf_gemma4.ARCHS:  # names of its own, optional scales as ones
            self.names = gguf_gemma4.hf_names(file, int(config.num_hidden_layers))
            self.derived = gguf_gemma4.derived(file, config)
        elif file.arch in gguf_llama4.ARCHS:  # names of its own (feed_forward, router)
            self.names = gguf_llama4.hf_names(file, int(config.num_hidden_layers))

    def __contains__(self, name: str) -> bool:
        return name in self.derived or name in self.names or name in self.pairs

    def gguf_name(self, name: str) -> str:
        try:
            return self.names[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found") from None

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` (an HF name) as float32, dequantized from its stored type."""
        if name in self.derived:
            derived = self.derived[name]
            return derived.build(*(self._dequantize(self.file.tensors[n]) for n in derived.sources))
        if name in self.pairs:
            first, second = (self._dequantize(self.file.tensors[n]) for n in self.pairs[name])
            if first.shape != second.shape:
                raise CheckpointError(
                    f"{self.model_dir}: {' and '.join(self.pairs[name])} differ in shape "
                    f"({list(first.shape)}, {list(second.shape)})"
                )
            return torch.stack([first, second], dim=-1).flatten(-2)
        t = self.file.tensors[self.gguf_name(name)]
        value = self._dequantize(t)
        if t.name.endswith("ffn_gate_inp_shexp.weight") and value.dim() == 1:
            value = value.unsqueeze(0)  # HF: shared_expert_gate [1, D]
        if self.file.arch == "llama":
            if re.search(r"\.attn_q\.(weight|bias)$", t.name):
                value = _unpermute(value, self._heads[0])
            elif re.search(r"\.attn_k\.(weight|bias)$", t.name):
                value = _unpermute(value, self._heads[1])
        return value

    def _dequantize(self, t: _Tensor) -> torch.Tensor:
        codec = GGUF_CODECS.get(t.ggml_type)
        if codec is not None:
            raw = torch.empty(t.nbytes, dtype=torch.uint8)
            self.io.read_into(t.offset, raw)
            cols = t.shape[-1]
            rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
            return codec.decode(raw, rows, cols, torch.float32).reshape(t.shape)
        # Non-expert tensors are read once at load: any type the gguf package dequantizes.
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            values = dequantize(np.asarray(t.data), GGMLQuantizationType(t.ggml_type))
        except NotImplementedError:
            raise CheckpointError(
                f"{self.model_dir}: tensor {t.name} is stored as "
                f"{ggml_type_name(t.ggml_type)}, which cannot be dequantized"
            ) from None
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(t.shape)

    def close(self) -> None:
        self.io.close()


def _hf_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m is not None and f"{m.group(2)}.{m.group(3)}" in _BLOCK_TENSORS:
        return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[f'{m.group(2)}.{m.group(3)}']}"
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


@dataclass(frozen=True)
class _ExpertSource:
    """Where one MoE layer's experts lie: per matrix (gate, up, down) each expert's byte
    offset, the bytes of one expert's matrix, its codec and the GGUF type it is stored in
    (a transcoded type is rearranged as read, gguf_quants.GGUF_TRANSCODED); `dims` (I, D)."""

    offsets: tuple[list[int], list[int], list[int]]
    sizes: tuple[int, int, int]
    codecs: tuple[MatrixCodec, MatrixCodec, MatrixCodec]
    dims: tuple[int, int]
    types: tuple[int, int, int]


class GGUFExpertLayout(ExpertLayout):
    """The routed experts of a GGUF file, read by offset and packed in their stored block types
    (the `ExpertLayout` interface the tiers use). Merged per layer (`blk.N.ffn_gate_exps`
    [E, I, D], each expert's blocks contiguous), as llama.cpp writes since 2024, or one tensor
    per expert (`blk.N.ffn_gate.E.weight`), as its first Mixtral files did."""

    def __init__(self, file: _GGUFFile, ckpt: GGUFCheckpoint, layers: list[int], num_experts: int):
        self.file = file
        self.ckpt = ckpt  # type: ignore[assignment]
        self.num_experts = num_experts
        self._io = ckpt.io  # one file descriptor per file, as a safetensors Checkpoint has
        self.layer_sources: dict[int, _ExpertSource] = {
            layer: self._layer_source(layer) for layer in layers
        }
        self.shape = self._infer_shape()

    def _layer_source(self, layer: int) -> _ExpertSource:
        path, e = self.file.path, self.num_experts
        if f"blk.{layer}.ffn_gate.0.weight" in self.file.tensors:
            per_expert = [
                [self._tensor(f"blk.{layer}.{part}.{x}.weight", layer) for x in range(e)]
                for part in ("ffn_gate", "ffn_up", "ffn_down")
            ]
            for tensors in per_expert:
                kinds = {(t.ggml_type, t.shape, t.nbytes) for t in tensors}
                if len(kinds) != 1 or len(tensors[0].shape) != 2:
                    raise CheckpointError(
                        f"{path}: layer {layer}'s {tensors[0].name.rsplit('.', 3)[0]}.E tensors "
                        f"differ in type or shape, or are not matrices"
                    )
            heads = [ts[0] for ts in per_expert]
            shapes = [tuple(t.shape) for t in heads]
            offsets = tuple([t.offset for t in ts] for ts in per_expert)
            sizes = tuple(t.nbytes for t in heads)
        elif f"blk.{layer}.ffn_gate_up_exps.weight" in self.file.tensors:
            heads, shapes, offsets, sizes = self._fused_gate_up(layer)
        else:
            heads = [self._tensor(f"blk.{layer}.{part}.weight", layer) for part in _EXPERT_PARTS]
            for t in heads:
                if len(t.shape) != 3 or t.shape[0] != e:
                    raise CheckpointError(
                        f"{path}: {t.name} has shape {list(t.shape)}; expected "
                        f"[{e}, rows, cols] (one matrix per expert)"
                    )
            shapes = [tuple(t.shape[1:]) for t in heads]
            sizes = tuple(t.nbytes // e for t in heads)
            offsets = tuple([t.offset + x * n for x in range(e)] for t, n in zip(heads, sizes))
        (gi, gd), up, (dd, di) = shapes
        if up != (gi, gd) or (dd, di) != (gd, gi):
            raise CheckpointError(
                f"{path}: layer {layer} experts gate {list(shapes[0])}, up {list(up)} and down "
                f"{[dd, di]} do not fit together ([I, D], [I, D], [D, I] per expert)"
            )
        try:
            codecs = tuple(codec_for(t.ggml_type, t.name, path) for t in heads)
            for t, c, (rows, cols), n in zip(heads, codecs, shapes, sizes):
                if c.nbytes(rows, cols) != n:
                    raise ValueError(f"tensor {t.name} has {n} bytes per expert, not its shape's")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        types = tuple(t.ggml_type for t in heads)
        return _ExpertSource(offsets, sizes, codecs, (gi, gd), types)  # type: ignore[arg-type]

    def _fused_gate_up(self, layer: int) -> tuple[list[_Tensor], list[Any], Any, Any]:
        """`blk.N.ffn_gate_up_exps` [E, 2I, D] (each expert's gate rows, then its up rows, as
        llama.cpp's converter writes HF's fused `gate_up_proj`) read as gate and up: whole rows
        of whole blocks, so each half is a contiguous run of the expert's bytes."""
        e = self.num_experts
        fused = self._tensor(f"blk.{layer}.ffn_gate_up_exps.weight", layer)
        down = self._tensor(f"blk.{layer}.ffn_down_exps.weight", layer)
        for t in (fused, down):
            if len(t.shape) != 3 or t.shape[0] != e:
                raise CheckpointError(
                    f"{self.file.path}: {t.name} has shape {list(t.shape)}; expected "
                    f"[{e}, rows, cols] (one matrix per expert)"
                )
        rows, cols = fused.shape[1:]
        if rows % 2:
            raise CheckpointError(
                f"{self.file.path}: {fused.name} has {rows} rows per expert, not gate and up"
            )
        n = fused.nbytes // e
        half = _Tensor(fused.name, fused.ggml_type, (e, rows // 2, cols), 0, n // 2, None)
        heads = [half, half, down]
        shapes = [(rows // 2, cols), (rows // 2, cols), tuple(down.shape[1:])]
        d = down.nbytes // e
        offsets = (
            [fused.offset + x * n for x in range(e)],
            [fused.offset + x * n + n // 2 for x in range(e)],
            [down.offset + x * d for x in range(e)],
        )
        return heads, shapes, offsets, (n // 2, n // 2, d)

    def _tensor(self, name: str, layer: int) -> _Tensor:
        t = self.file.tensors.get(name)
        if t is None:
            raise CheckpointError(
                f"{self.file.path}: MoE layer {layer} has no routed-expert tensor {name}"
            )
        return t

    def _infer_shape(self) -> ExpertShape:
        shapes = {src.dims for src in self.layer_sources.values()}
        if len(shapes) != 1:
            raise CheckpointError(
                f"{self.file.path}: MoE layers have different expert shapes {sorted(shapes)}"
            )
        i, d = shapes.pop()
        return ExpertShape(hidden=d, intermediate=i)

    @property
    def layers(self) -> list[int]:
        return sorted(self.layer_sources)

    def packing(self, dtype: torch.dtype) -> ExpertPacking:
        return ExpertPacking(
            {
                layer: ExpertFormat(self.shape, dtype, src.codecs)
                for layer, src in self.layer_sources.items()
            }
        )

    def source_bytes(self, layer: int, expert: int) -> int:
        return sum(self.layer_sources[layer].sizes)

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> int:
        """Read expert (layer, expert)'s stored blocks into the packed CPU uint8 row `out`."""
        src = self.layer_sources[layer]
        fmt = ExpertFormat(self.shape, torch.float32, src.codecs)
        d, i = self.shape.hidden, self.shape.intermediate
        dims = ((i, d), (i, d), (d, i))
        for offsets, part, ggml_type, (rows, cols) in zip(
            src.offsets, fmt.parts(out), src.types, dims
        ):
            self._io.read_into(offsets[expert], part)
            transcoded = GGUF_TRANSCODED.get(ggml_type)
            if transcoded is not None:  # MXFP4: rearranged into the codec's layout, in place
                part.copy_(transcoded.convert(part, rows, cols))
        return sum(src.sizes)


def _has_experts(file: _GGUFFile, layer: int) -> bool:
    names = (
        f"blk.{layer}.ffn_gate_exps.weight",
        f"blk.{layer}.ffn_gate.0.weight",
        f"blk.{layer}.ffn_gate_up_exps.weight",  # gate and up fused (gemma4)
    )
    return any(n in file.tensors for n in names)


def _config(file: _GGUFFile) -> Any:
    """The HF config of the file's model: transformers' GGUF mapping (qwen2moe, qwen3moe),
    completed with what it leaves out (the expert widths); Mixtral and gpt-oss mapped here."""
    arch = file.arch
    if arch == "clip":  # llama.cpp's multimodal projector, shipped beside the model's file
        raise CheckpointError(
            f"{file.path}: a vision projector (mmproj) file, not a model; pass the model's GGUF "
            f"file (moetier runs the language model and reads no projector)"
        )
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"{file.path}: GGUF architecture {arch or '(none)'!r} is not supported; moetier reads "
            f"GGUF files of: {', '.join(sorted(SUPPORTED_ARCHS))} (with experts)"
        )
    if file.get("expert_count") is None:
        raise CheckpointError(
            f"{file.path}: a {arch} GGUF file without experts ({arch}.expert_count is missing); "
            f"moetier runs mixture-of-experts models"
        )
    from transformers import AutoConfig

    layers = int(file.require("block_count"))
    moe_layers = [n for n in range(layers) if _has_experts(file, n)]
    if arch == "llama":
        return AutoConfig.for_model("mixtral", **_mixtral_config(file, layers))
    if arch == "gpt-oss":
        return AutoConfig.for_model("gpt_oss", **gguf_gpt_oss.config(file, layers))
    if arch in gguf_olmoe.ARCHS:
        return AutoConfig.for_model("olmoe", **gguf_olmoe.config(file, layers))
    if arch in HYBRID_ARCHS:
        return AutoConfig.for_model(**hybrid_config(file))
    if arch in gguf_deepseek.ARCHS:
        model_type, kwargs = gguf_deepseek.config(file, layers)
        return AutoConfig.for_model(model_type, **kwargs)
    if arch in gguf_gemma4.ARCHS:
        return AutoConfig.for_model("gemma4_text", **gguf_gemma4.config(file, layers))
    if arch in gguf_llama4.ARCHS:
        return AutoConfig.for_model("llama4_text", **gguf_llama4.config(file, layers))
    try:
        config = AutoConfig.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{file.path}: transformers cannot read its config ({exc})") from exc
    config.architectures = [SUPPORTED_ARCHS[arch]]
    # transformers maps feed_forward_length only; the expert widths come from their own keys
    gate = file.tensors.get(f"blk.{moe_layers[0]}.ffn_gate_exps.weight") if moe_layers else None
    width = file.get("expert_feed_forward_length") or (gate.shape[1] if gate else None)
    if width is not None:
        config.moe_intermediate_size = int(width)
    shared = file.tensors.get(f"blk.{moe_layers[0]}.ffn_gate_shexp.weight") if moe_layers else None
    if arch == "qwen2moe":
        shared_width = file.get("expert_shared_feed_forward_length") or (
            shared.shape[0] if shared else None
        )
        if shared_width is not None:
            config.shared_expert_intermediate_size = int(shared_width)
    config.mlp_only_layers = [n for n in range(layers) if n not in moe_layers]
    config.decoder_sparse_step = 1
    return config


def _mixtral_config(file: _GGUFFile, layers: int) -> dict[str, Any]:
    hidden = int(file.require("embedding_length"))
    heads = int(file.require("attention.head_count"))
    out: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHS["llama"]],
        "vocab_size": file.vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": int(file.require("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.get("attention.head_count_kv", heads)),
        "head_dim": int(file.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(file.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(file.get("context_length", 4096)),
        "num_local_experts": int(file.require("expert_count")),
        "num_experts_per_tok": int(file.require("expert_used_count")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(file.get("rope.freq_base", 1e6)),
        },
        "sliding_window": None,
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    # the expert width (Mixtral: = feed_forward_length): merged [E, I, D] or per expert [I, D]
    merged, first = (file.tensors.get(f"blk.0.ffn_gate{s}.weight") for s in ("_exps", ".0"))
    if merged is not None:
        out["intermediate_size"] = merged.shape[1]
    elif first is not None:
        out["intermediate_size"] = first.shape[0]
    for key in ("bos_token_id", "eos_token_id"):
        value = file.fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            out[key] = int(value)
    return out


class GGUFModel:
    """A GGUF file opened for the engine: `config` first (the family is chosen from it), then
    `open(moe_layers)` for the checkpoint and the expert layout."""

    def __init__(self, path: str | Path) -> None:
        self.file = _GGUFFile(Path(path))
        self.config = _config(self.file)

    def moe_layers(self) -> list[int]:
        """The blocks that hold routed experts."""
        n = int(self.config.num_hidden_layers)
        return [i for i in range(n) if _has_experts(self.file, i)]

    def open(
        self, moe_layers: Iterable[int] | None = None
    ) -> tuple[GGUFCheckpoint, GGUFExpertLayout]:
        from moetier.layers.moe import moe_config

        layers = self.moe_layers() if moe_layers is None else sorted(moe_layers)
        ckpt = GGUFCheckpoint(self.file, self.config)
        num_experts, _, _ = moe_config(self.config)
        return ckpt, GGUFExpertLayout(self.file, ckpt, layers, num_experts)


def open_gguf(path: str | Path) -> tuple[Any, GGUFCheckpoint, GGUFExpertLayout]:
    """(HF config, non-expert checkpoint, expert layout) of a GGUF file."""
    model = GGUFModel(path)
    return (model.config, *model.open())
