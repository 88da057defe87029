"""Demo-model variants: expert count, top-k, perturbation and seed, their names and sizes.

A `DemoSpec` names one variant of the demo (the default is the 16-expert top-2 demo with
identical experts). Its directory name under `<home>/demo/` encodes every setting, so variants
are cached side by side; its size is known before anything is built, so the CLI can print it
and the builder can refuse to start on a disk that is too small. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetier.errors import ConfigError

# SmolLM2-135M-Instruct's shapes (the demo's only source model), bfloat16 on disk
SOURCE_LAYERS = 30
SOURCE_HIDDEN = 576
SOURCE_FFN = 1536
SOURCE_VOCAB = 49152
DTYPE_BYTES = 2
# embeddings (tied), attention and norms: the 16x2 build's index total (2,658,370,176 bytes)
# less its 16 x 30 experts and 30 routers
_EXPERT_BYTES = 3 * SOURCE_HIDDEN * SOURCE_FFN * DTYPE_BYTES
_ROUTER_ROW_BYTES = SOURCE_HIDDEN * DTYPE_BYTES
NON_EXPERT_BYTES = 2_658_370_176 - SOURCE_LAYERS * 16 * (_EXPERT_BYTES + _ROUTER_ROW_BYTES)
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class DemoSpec:
    """One demo variant: num_experts copies (perturbed when perturb > 0) per layer, top_k routed.

    seed seeds the router fit (layer l's k-means uses seed + l) and the experts' noise.
    """

    num_experts: int = 16
    top_k: int = 2
    perturb: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts <= MAX_EXPERTS:
            raise ConfigError(f"--experts must be 1..{MAX_EXPERTS}, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"--top-k must be 1..experts ({self.num_experts}), got {self.top_k}")
        if not 0.0 <= self.perturb <= 10.0:
            raise ConfigError(f"--perturb is a relative noise scale in [0, 10], got {self.perturb}")
        if self.seed < 0:
            raise ConfigError(f"--seed must not be negative, got {self.seed}")

    @property
    def name(self) -> str:
        """Directory name: smollm2-moe-<E>x<K>[-p<perturb>][-s<seed>] (16x2 is the demo's)."""
        name = f"smollm2-moe-{self.num_experts}x{self.top_k}"
        if self.perturb > 0:
            name += f"-p{self.perturb:g}"
        if self.seed:
            name += f"-s{self.seed}"
        return name

    @property
    def is_default(self) -> bool:
        return self == DemoSpec()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (w1, w2, w3) in bfloat16."""
        return _EXPERT_BYTES

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the safetensors shards this variant writes (headers not counted)."""
        per_expert = self.expert_bytes + _ROUTER_ROW_BYTES
        return NON_EXPERT_BYTES + SOURCE_LAYERS * self.num_experts * per_expert

    @property
    def needed_disk_bytes(self) -> int:
        """Free space a build needs: the checkpoint, the source GGUF and some slack."""
        return self.checkpoint_bytes + 300 * 1024**2


DEFAULT_SPEC = DemoSpec()
