"""GGUF tensor names -> HF names, shared by the per-architecture GGUF modules: the global tensors
llama.cpp names alike for every architecture, and a block's `blk.N.<leaf>.<suffix>` through an
architecture's table."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetier.weights.gguf import _GGUFFile

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.([a-z]+)$")


def block_names(file: _GGUFFile, layers: int, table: Mapping[str, str]) -> dict[str, str]:
    """HF name -> GGUF name of the global tensors and of every tensor of the first `layers`
    blocks that `table` names: a key `leaf.suffix` gives the whole HF leaf, a key `leaf` the HF
    leaf the tensor's suffix (`.weight`, `.bias`) follows."""
    out: dict[str, str] = {}
    for name in file.tensors:
        if name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = name
            continue
        m = BLOCK.match(name)
        if m is None or int(m.group(1)) >= layers:
            continue
        layer, leaf, suffix = m.group(1), m.group(2), m.group(3)
        if f"{leaf}.{suffix}" in table:
            out[f"model.layers.{layer}.{table[f'{leaf}.{suffix}']}"] = name
        elif leaf in table:
            out[f"model.layers.{layer}.{table[leaf]}.{suffix}"] = name
    return out
