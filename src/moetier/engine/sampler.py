"""Turns last-position logits into next tokens: greedy, temperature, top-k, top-p, seeded, and
constrained by a request's grammar (structured.py masks the logits first)."""

from __future__ import annotations

import torch

from moetier.core import SamplingParams
from moetier.engine.structured import GrammarMasks


class Sampler:
    """Per-request sampling with a per-request generator so results do not depend on batching."""

    def __init__(self, seed: int = 0, grammars: GrammarMasks | None = None) -> None:
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}
        self.grammars = grammars  # None: no request may be constrained

    def sample(
        self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams]
    ) -> list[int]:
        """logits [N, V] float32 -> one token id per row.

        Everything runs where the logits are (on CUDA: no copy of the vocabulary-sized rows to
        the host, generators on the device); the chosen ids come back in one read. Rows of
        constrained requests are masked to their grammar first, and their matchers advance.
        """
        if self.grammars is not None:
            logits = self.grammars.apply(logits, request_ids)
        tokens = self._choose(logits, request_ids, params)
        if self.grammars is not None:
            self.grammars.advance(request_ids, tokens)
        return tokens

    def _choose(
        self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams]
    ) -> list[int]:
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        chosen = [
            logits[i].argmax(dim=-1, keepdim=True)
            if p.greedy
            else self._sample_one(logits[i], request_ids[i], p)
            for i, p in enumerate(params)
        ]
        return torch.cat(chosen).tolist()

    def _sample_one(self, logits: torch.Tensor, request_id: int, p: SamplingParams) -> torch.Tensor:
        """One row's token id as a [1] tensor on the logits' device."""
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(p.seed if p.seed is not None else self.seed * 1_000_003 + request_id)
            self._generators[request_id] = gen
        scores = logits.float() / p.temperature
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
        return torch.multinomial(probs, 1, generator=gen)

    def forget(self, request_id: int) -> None:
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_id)
