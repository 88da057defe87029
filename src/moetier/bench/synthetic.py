"""Synthetic checkpoints with real MoE shapes (random bf16 weights), cached, and a decode bench.

Owns the seeded weight fill (the shapes are in bench/shapes.py) and the on-disk cache of
generated checkpoints (`$MOETIER_HOME/synthetic/<shape>-L<layers>-s<seed>/`, reused once its
marker file exists); it measures nothing beyond the small legacy decode benchmark at the bottom.

The gpt-oss shapes store their experts in MXFP4 as the released checkpoints do (random block
bytes, scales that give bf16-like magnitudes; `quantization_config.quant_method: mxfp4`).
Multimodal releases (Qwen3.6, Gemma 4) are written as their text model alone, the CausalLM
class moetier loads (`Qwen3_5MoeForCausalLM`, `Gemma4ForCausalLM`): same layers and tensor
shapes, without the `model.language_model.` prefix and the vision tower.

Random weights give near-random routing: results measure the transfer path under uniform
expert demand, not real-text locality. Say so beside any number this produces. Deep random
stacks route degenerately (the hidden state stops depending on the token): use the bench's
routing override (`--routing uniform` or `trace:PATH`) on them.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import statistics
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moetier.bench.shapes import (
    DEFAULT_LAYERS,
    MXFP4_QUANTIZATION,
    MXFP4_SHAPES,
    SHAPES,
    shape_config,
)
from moetier.layers.moe import moe_config

log = logging.getLogger(__name__)

MARKER = "synthetic-complete.json"
# Multiplicative scales filled with ones, as HF initializes them (Gemma 4's per-layer output
# scalar and router scales, DeepSeek-V4's hyper-connection scales): random ones would flip signs
# and compound over the layers.
_ONES = (
    ".layer_scalar",
    ".router.scale",
    ".router.per_expert_scale",
    ".hc_attn_scale",
    ".hc_ffn_scale",
    ".hc_scale",
)
_CPU_POOL = 1_000_003  # prime: tiled pool slices never align with expert or row boundaries


def moetier_home() -> Path:
    """$MOETIER_HOME, else ~/.cache/moetier."""
    return Path(os.environ.get("MOETIER_HOME") or Path.home() / ".cache" / "moetier")


# Expert storage formats a synthetic checkpoint can be written in (`--format`). gguf-*: one
# GGUF file (`model.gguf`) with experts as random valid blocks of that type (q4_k_m: gate and
# up Q4_K, down Q6_K) and the other weights F16.
GGUF_FORMATS: dict[str, tuple[str, str, str]] = {
    "gguf-q4_k": ("gguf-q4_k",) * 3,
    "gguf-q4_k_m": ("gguf-q4_k", "gguf-q4_k", "gguf-q6_k"),
    "gguf-q6_k": ("gguf-q6_k",) * 3,
    "gguf-q8_0": ("gguf-q8_0",) * 3,
}
FORMATS = ("bf16", "fp8", *GGUF_FORMATS)
GGUF_FILE = "model.gguf"
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def synthetic_dir(shape: str, num_layers: int, seed: int, fmt: str = "bf16") -> Path:
    suffix = "" if fmt == "bf16" else f"-{fmt}"
    return moetier_home() / "synthetic" / f"{shape}-L{num_layers}-s{seed}{suffix}"


def checkpoint_plan(config: Any) -> tuple[str, dict[str, torch.Size]]:
    """(CausalLM class name, {tensor name: shape}) of the bf16 checkpoint `write_synthetic`
    writes for `config`: the transformers model's state dict, built on the meta device (routed
    experts fused: `experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]). A tied LM
    head is left out, as save_pretrained leaves it. _SAVED_NAMES families are named as
    save_pretrained names them (experts still fused)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    rename = _saved_names(model) if config.model_type in _SAVED_NAMES else (lambda n: n)
    plan = {
        rename(name): p.shape
        for name, p in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    return type(model).__name__, plan


# Model types whose moetier family reads the tensor names save_pretrained writes (near the
# release's; transformers renames them on load) rather than the names it holds in memory.
# DeepSeek-V4: `attn.wq_a`, `ffn.experts`, `hc_attn_fn`, `head.weight` for `self_attn.q_a_proj`,
# `mlp.experts`, `attn_hc.fn`, `lm_head.weight`. (Mixtral and Qwen3.6 would be renamed too, but
# their families read the in-memory names, which transformers also loads.)
_SAVED_NAMES = frozenset({"deepseek_v4"})
# Model types whose family refuses a quantization_config (models/deepseek_v4.py): bf16 only.
_FLOAT_ONLY = frozenset({"deepseek_v4"})


def _saved_names(model: Any) -> Callable[[str], str]:
    """In-memory name -> the name save_pretrained gives it: transformers' own renamings of the
    family, reversed (its converters, which split fused experts, are not applied)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming, apply_renamings

    mapping = get_model_conversion_mapping(model, add_legacy=False)  # as save_pretrained
    reverse = [c.reverse_transform() for c in mapping[::-1]]
    renamings = [
        r for r in reverse if isinstance(r, WeightRenaming) and not isinstance(r, PrefixChange)
    ]
    return lambda name: apply_renamings(name, renamings)


def _hash_table(filler: _Filler, name: str, shape: torch.Size, experts: int) -> torch.Tensor:
    """A hash router's `tid2eid` [vocab, K] int64: K distinct experts per token id, uniformly
    drawn (transformers initializes it to zeros; the release's table is learned offline)."""
    gen = filler._gen(name)
    scores = torch.rand(shape[0], experts, generator=gen, device=filler.device)
    return scores.topk(shape[1], dim=1).indices.cpu()


def _mxfp4_experts(filler: _Filler, name: str, shape: torch.Size) -> dict[str, torch.Tensor]:
    """HF's float expert tensor `name` [E, cols, rows] as MXFP4 blocks [E, rows, cols/32, 16]
    + scales [E, rows, cols/32]: random nibbles, one scale for the whole tensor putting the
    values' RMS near 1/sqrt(cols) (random FP4 nibbles have an RMS of 2.93 units)."""
    import math

    e, cols, rows = shape
    gen = filler._gen(name)
    size = (e, rows, cols // 32, 16)
    blocks = torch.randint(0, 256, size, dtype=torch.uint8, generator=gen, device=filler.device)
    blocks = blocks.cpu()
    exp = round(math.log2(1.0 / (2.93 * math.sqrt(cols))))
    scales = torch.full((e, rows, cols // 32), 127 + exp, dtype=torch.uint8)
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


class _Filler:
    """Seeded bf16 weights; each tensor's values depend only on (seed, name, fill device).

    CUDA: `torch.randn` with a CUDA generator (fast). CPU: small tensors get `randn`; large ones
    are tiled from one seeded random pool at a per-tensor offset (CPU `randn` is single-threaded
    and takes minutes at real sizes; the tiling costs a memcpy). The same seed gives different
    weights on the two fill devices.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device
        self._pool: torch.Tensor | None = None

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(
            self.seed * 1_000_003 + zlib.crc32(name.encode())
        )

    def __call__(self, name: str, shape: torch.Size) -> torch.Tensor:
        if "norm" in name or name.endswith(_ONES):
            return torch.ones(shape, dtype=torch.bfloat16)
        scale = 1.0 / max(shape[-1] if len(shape) else 1, 1) ** 0.5
        numel = shape.numel()
        gen = self._gen(name)
        if self.device.type == "cuda":
            t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)
            return t.mul_(scale).cpu()
        if numel <= 1 << 20:
            return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
        if self._pool is None:
            pool_gen = torch.Generator().manual_seed(self.seed)
            self._pool = torch.randn(_CPU_POOL, generator=pool_gen).to(torch.bfloat16)
        offset = int(torch.randint(_CPU_POOL, (1,), generator=gen))
        reps = (numel + offset) // _CPU_POOL + 1
        flat = self._pool.repeat(reps)[offset : offset + numel]
        return flat.view(shape).mul_(scale)


def _shard_of(name: str) -> str:
    return (
        f"layer-{int(name.split('.')[2]):03d}.safetensors"
        if ".layers." in name
        else ("rest.safetensors")
    )


def write_synthetic(
    path: Path,
    shape: str,
    num_layers: int,
    seed: int = 0,
    device: str | None = None,
    fmt: str = "bf16",
) -> Path:
    """Write a `num_layers`-layer checkpoint of `shape` to `path`, one shard per layer.

    bf16: experts are stored fused (`experts.gate_up_proj`, `experts.down_proj`) as
    transformers saves them; the MXFP4 shapes (gpt-oss) store `*_blocks` + `*_scales` instead.
    fp8: per expert in e4m3 with 128x128 block scales (`weight_scale_inv`), the layout of
    Qwen3-*-FP8 and DeepSeek-V3 (other weights bf16). gguf-*: one GGUF file in `path`
    (`write_synthetic_gguf`), whose path is returned. `device`: where to fill (default CUDA
    when available). A writer thread saves one shard while the next is filled, so a GPU fill
    runs at disk speed.
    """
    if fmt not in FORMATS:
        from moetier.errors import ConfigError

        raise ConfigError(f"unknown synthetic format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt in GGUF_FORMATS:
        path.mkdir(parents=True, exist_ok=True)
        return write_synthetic_gguf(path / GGUF_FILE, shape, num_layers, seed, device, fmt)
    config = shape_config(shape, num_layers)
    architecture, plan = checkpoint_plan(config)
    config.architectures = [architecture]
    if fmt == "fp8" and config.model_type in _FLOAT_ONLY:
        from moetier.errors import ConfigError

        raise ConfigError(
            f"synthetic {shape} in fp8: moetier reads {config.model_type} checkpoints without a "
            "quantization_config only; use --format bf16"
        )
    if fmt == "fp8":
        config.quantization_config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    fill_dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    filler = _Filler(seed, fill_dev)
    mxfp4 = shape in MXFP4_SHAPES
    if mxfp4:
        config.quantization_config = MXFP4_QUANTIZATION
        config.save_pretrained(path)

    def tensors(name: str, shape: torch.Size) -> dict[str, torch.Tensor]:
        if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return _mxfp4_experts(filler, name, shape)
        if name.endswith(".tid2eid"):
            return {name: _hash_table(filler, name, shape, moe_config(config)[0])}
        return {name: filler(name, shape).contiguous()}

    groups: dict[str, dict[str, torch.Size]] = {}
    for name, size in plan.items():
        groups.setdefault(_shard_of(name), {})[name] = size
    done: queue.Queue[tuple[str, dict[str, torch.Tensor]] | None] = queue.Queue(maxsize=1)
    errors: list[BaseException] = []

    def writer() -> None:
        while (item := done.get()) is not None:
            try:
                save_file(item[1], str(path / item[0]), metadata={"format": "pt"})
            except BaseException as exc:  # reported by the caller below
                errors.append(exc)

    weight_names: dict[str, list[str]] = {}
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for shard, names in groups.items():
            shard_tensors: dict[str, torch.Tensor] = {}
            for n, s in names.items():
                shard_tensors.update(tensors(n, s))
            if fmt == "fp8":
                shard_tensors = _fp8_experts(shard_tensors, fill_dev)
            weight_names[shard] = list(shard_tensors)
            done.put((shard, shard_tensors))
    finally:
        done.put(None)
        thread.join()
    if errors:
        raise errors[0]
    weight_map = {n: shard for shard, names in weight_names.items() for n in names}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _fp8_experts(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Fused bf16 experts of one shard -> per-expert e4m3 + float32 128x128 block scales. One
    scale for every block (the weights are random: a per-block amax would buy nothing), chosen
    so the values span e4m3's range without saturating (|w| / scale <= ~7 sigma x 64)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = t
            continue
        t = t.to(device)
        scale = 1.0 / (64 * t.shape[-1] ** 0.5)
        parts = [("gate_proj", "up_proj"), ("down_proj",)][name.endswith("down_proj")]
        for e in range(t.shape[0]):
            for j, part in enumerate(parts):
                rows = t.shape[1] // len(parts)
                w = t[e, j * rows : (j + 1) * rows]
                key = f"{base}.{e}.{part}.weight"
                out[key] = (w.float() / scale).to(torch.float8_e4m3fn).cpu()
                blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
                out[key + "_scale_inv"] = torch.full(blocks, scale, dtype=torch.float32)
    return out


def write_synthetic_gguf(
    file: Path,
    shape: str,
    num_layers: int,
    seed: int = 0,
    device: str | None = None,
    fmt: str = "gguf-q4_k_m",
) -> Path:
    """Write `shape` as one GGUF file: experts (`blk.N.ffn_{gate,up,down}_exps`) as random
    valid blocks of the format's types (no float matrix is quantized: the gguf package has no K
    quantizer, and random weights would gain nothing from one), other weights F16 from the
    seeded filler, norms F32 ones. Tensors stream to the file one by one (never all in RAM)."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    from moetier.errors import ConfigError
    from moetier.weights.formats import get_codec
    from moetier.weights.gguf_quants import GGUFCodec, random_blocks

    config = shape_config(shape, num_layers)
    arch = _GGUF_ARCH.get(config.model_type)
    if arch is None:
        raise ConfigError(
            f"synthetic shape {shape!r} ({config.model_type}) has no GGUF writer; GGUF formats "
            f"are written for {', '.join(sorted(_GGUF_ARCH))} shapes"
        )
    codecs: list[GGUFCodec] = []
    for codec_name in GGUF_FORMATS[fmt]:
        codec = get_codec(codec_name)
        assert isinstance(codec, GGUFCodec)
        codecs.append(codec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = gguf.get_tensor_name_map(
        {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "llama": gguf.MODEL_ARCH.LLAMA}[arch], num_layers
    )
    # (GGUF name, fill key, torch shape [.., rows, cols], codec or None = F16 / F32 norms)
    plan: list[tuple[str, str, tuple[int, ...], Any]] = []
    for name, p in model.state_dict().items():
        if ".experts." in name:
            layer = name.split(".")[2]
            e, rows, cols = p.shape
            if name.endswith("gate_up_proj"):
                plan.append((f"blk.{layer}.ffn_gate_exps.weight", name, (e, rows // 2, cols), 0))
                plan.append((f"blk.{layer}.ffn_up_exps.weight", name, (e, rows // 2, cols), 1))
            else:
                plan.append((f"blk.{layer}.ffn_down_exps.weight", name, (e, rows, cols), 2))
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ConfigError(f"synthetic {shape}: no GGUF name for {name}")
        plan.append((f"{gguf_name}.{suffix}", name, tuple(p.shape), None))
    for gguf_name, _, dims, k in plan:
        if k is not None:
            try:
                codecs[k].nbytes(dims[1], dims[2])
            except ValueError as exc:
                raise ConfigError(f"synthetic {shape} in {fmt}: {gguf_name}: {exc}") from None
    w = gguf.GGUFWriter(str(file), arch)
    _gguf_metadata(w, arch, config, shape)
    for gguf_name, _, dims, k in plan:
        if k is None:
            dtype = np.float32 if "norm" in gguf_name else np.float16
            nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
            w.add_tensor_info(gguf_name, dims, np.dtype(dtype), nbytes)
        else:
            c = codecs[k]
            nbytes = dims[0] * c.nbytes(dims[1], dims[2])
            byte_shape = (dims[0], dims[1], nbytes // dims[0] // dims[1])
            w.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), nbytes, c.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    filler = _Filler(seed, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    for gguf_name, key, dims, k in plan:
        if k is None:
            t = filler(key, torch.Size(dims)).float()
            w.write_tensor_data(t.numpy().astype(np.float32 if "norm" in gguf_name else np.float16))
            continue
        c = codecs[k]
        e, rows, cols = dims
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(gguf_name.encode()))
        blocks = random_blocks(c, e * rows, cols, 2.0 / cols**0.5, gen)
        w.write_tensor_data(blocks.numpy().reshape(e, rows, -1))
    w.close()
    return file


def _gguf_metadata(w: Any, arch: str, config: Any, shape: str) -> None:
    """llama.cpp's metadata keys for the config (what weights/gguf.py reads back)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_name(f"synthetic-{shape}")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_vocab_size(config.vocab_size)
    w.add_feed_forward_length(config.intermediate_size)
    if arch == "llama":
        w.add_expert_count(config.num_local_experts)
    else:
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)


def ensure_synthetic(
    shape: str,
    num_layers: int | None = None,
    seed: int = 0,
    device: str | None = None,
    fmt: str = "bf16",
) -> Path:
    """The cached checkpoint of (shape, layers, seed, format); generated first when missing or
    partial. The marker file is written last, so an interrupted write is detected and redone.
    A GGUF format gives the .gguf file (in that directory, beside the marker).
    """
    layers = num_layers or DEFAULT_LAYERS.get(shape, 4)
    path = synthetic_dir(shape, layers, seed, fmt)
    if (path / MARKER).exists():
        return path / GGUF_FILE if fmt in GGUF_FORMATS else path
    if path.exists():
        log.warning("removing incomplete synthetic checkpoint %s", path)
        shutil.rmtree(path)
    t0 = time.perf_counter()
    written = write_synthetic(path, shape, layers, seed, device, fmt)
    fill = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta = dict(
        shape=shape,
        layers=layers,
        seed=seed,
        format=fmt,
        fill_device=fill,
        write_s=round(time.perf_counter() - t0, 2),
    )
    (path / MARKER).write_text(json.dumps(meta) + "\n")
    log.info("wrote synthetic %s in %.1f s", path, meta["write_s"])
    return written


def decode_benchmark(
    path: Path,
    budget: str | None,
    prompt_len: int = 64,
    new_tokens: int = 64,
    device: str = "auto",
    dtype: str = "auto",
    moe_grouped_kernel: bool | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """TTFT and TPOT at batch 1 for one expert budget, with offload counters per token."""
    from moetier import LLM, SamplingParams

    llm = LLM(
        str(path),
        expert_budget=budget,
        device=device,
        dtype=dtype,
        progress=False,
        moe_grouped_kernel=moe_grouped_kernel,
        enable_prefix_caching=False,  # the timed prompt is the warm-up's: prefill it again
    )
    prompt = [(7 * i + 3) % 31000 + 1 for i in range(prompt_len)]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], warm)
    llm.engine.runner.stats.reset()
    engine = llm.engine
    # Sampled at temperature 1 so tokens (and routing) vary: greedy decoding of random weights
    # tends to repeat one token, which would make every step reuse the same experts.
    engine.add_request(
        prompt,
        SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed, ignore_eos=True),
    )
    times = []
    sync = torch.cuda.synchronize if llm.engine.runner.device.type == "cuda" else (lambda: None)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    s = llm.offload_stats()
    decode = times[1:]
    return {
        "budget": budget or "100%",
        "moe_compute": "loop" if moe_grouped_kernel is False else "default",
        "device_slots": s["device_slots"],
        "total_experts": s["total_experts"],
        "ttft_ms": times[0] * 1e3,
        "tpot_ms_median": statistics.median(decode) * 1e3,
        "tpot_ms_p99": sorted(decode)[int(0.99 * (len(decode) - 1))] * 1e3,
        "exposed_fetch_ms_per_token": s["exposed_fetch_s"] * 1e3 / len(times),
        "host_to_device_MB_per_token": s["bytes_host_to_device"] / 1e6 / len(times),
        "device_hit_rate": s["device_hit_rate"],
    }


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="decode benchmark on a synthetic real-shape MoE")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budgets", default="100%,50%,25%,10%")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seeds the weights and the sampling")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    ap.add_argument(
        "--compare-loop",
        action="store_true",
        help="also run each budget with the per-expert loop (grouped kernel off)",
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_synthetic(Path(tmp) / args.shape, args.shape, args.layers, args.seed)
        variants: list[bool | None] = [False, None] if args.compare_loop else [None]
        rows = [
            decode_benchmark(
                path,
                None if b == "100%" else b,
                args.prompt_len,
                args.new_tokens,
                moe_grouped_kernel=v,
                seed=args.seed,
            )
            for b in args.budgets.split(",")
            for v in variants
        ]
    result = {
        "shape": args.shape,
        "layers": args.layers,
        "weights": "random bf16 (near-random routing)",
        "seed": args.seed,
        "decode": f"sampled, temperature 1.0, seed {args.seed}",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch": 1,
        "torch": torch.__version__,
        "write_s": time.perf_counter() - t0,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
