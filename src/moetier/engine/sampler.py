"""Turns last-position logits into next tokens: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

from moetier.core import SamplingParams


class Sampler:
    """Per-request sampling with a per-request generator so results do not depend on batching."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams]
    ) -> list[int]:
        """logits [N, V] float32 -> one token id per row."""
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        out = [0] * len(params)
        if greedy_rows:
            ids = logits[greedy_rows].argmax(dim=-1).tolist()
            for row, tok in zip(greedy_rows, ids):
                out[row] = tok
        for i, p in enumerate(params):
            if not p.greedy:
                out[i] = self._sample_one(logits[i], request_ids[i], p)
        return out

    def _sample_one(self, logits: torch.Tensor, request_id: int, p: SamplingParams) -> int:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(p.seed if p.seed is not None else self.seed * 1_000_003 + request_id)
            self._generators[request_id] = gen
        scores = logits.float().cpu() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # drop a token when the mass strictly before it already reaches top_p
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen).item())

    def forget(self, request_id: int) -> None:
        self._generators.pop(request_id, None)
