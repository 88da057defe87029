"""Where a family's CUDA output leaves transformers': greedy tokens of the GPU suite's tiny
checkpoint (tests/models/families.py) from transformers on the CPU and on CUDA and from moetier
on CUDA (graphs on and off) and on the CPU, float32, with each prompt's last-token logit
distance. A token mismatch that transformers' own CPU and CUDA runs share is the checkpoint's
sensitivity; one only moetier's CUDA run shows is a bug on that path.

    python3 scripts/gpu_family_probe.py deepseek_v4 [more families]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS, hf_greedy, hf_last_logits, hf_model, moetier_greedy

from moetier import LLM


def main() -> None:
    for name in sys.argv[1:] or ["deepseek_v4"]:
        path = FAMILIES[name].checkpoint(Path(tempfile.mkdtemp()) / name)
        runs: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}
        for dev in ("cpu", "cuda"):
            ref = hf_model(path).to(dev)
            runs[f"hf-{dev}"] = (
                [hf_greedy(ref, p) for p in PROMPTS],
                [hf_last_logits(ref, p) for p in PROMPTS],
            )
        for label, kw in (
            ("moetier-cuda-graphs", dict(device="cuda")),
            ("moetier-cuda-eager", dict(device="cuda", cuda_graphs=False)),
            ("moetier-cpu", dict(device="cpu")),
        ):
            llm = LLM(str(path), dtype="float32", progress=False, **kw)
            runs[label] = (
                moetier_greedy(llm, PROMPTS),
                [llm.prompt_logits(p).float().cpu() for p in PROMPTS],
            )
        base_tokens, base_logits = runs["hf-cpu"]
        print(f"== {name}")
        for label, (tokens, logits) in runs.items():
            same = [t == b for t, b in zip(tokens, base_tokens)]
            dist = [f"{(a - b).abs().max().item():.2e}" for a, b in zip(logits, base_logits)]
            print(f"{label:22s} same tokens as hf-cpu per prompt {same}, logit max-abs {dist}")
            for p, t, b in zip(PROMPTS, tokens, base_tokens):
                if t != b:
                    first = next(i for i, (x, y) in enumerate(zip(t, b)) if x != y)
                    print(f"    prompt {p[:6]}: first differs at new token {first}")


if __name__ == "__main__":
    main()
