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
        """Every row at once: greedy rows take the argmax; the others are scaled by their
        temperature, masked by their top-k / top-p, and sampled by inverting their CDF at one
        uniform drawn from the request's own generator (on the host: one small copy for the
        batch, no per-row kernels), so a request's tokens do not depend on its batch mates."""
        out = logits.argmax(dim=-1)  # [N]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            ps = [params[i] for i in rows]
            u = torch.tensor(
                [self._uniform(request_ids[i], p) for i, p in zip(rows, ps)], dtype=torch.float32
            )
            index = torch.tensor(rows)
            dev = logits.device
            temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
            scores = logits[index.to(dev)].float() / temps.to(dev)[:, None]  # [R, V]
            scores = _top_k(scores, [p.top_k for p in ps])
            scores = _top_p(scores, [p.top_p for p in ps])
            cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)  # [R, V]
            target = u.to(dev)[:, None] * cdf[:, -1:]
            # right=True: the first token whose cumulative mass exceeds the target (never one
            # of probability 0, even at u = 0)
            drawn = (
                torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
            )
            out[index.to(dev)] = drawn
        return out.tolist()

    def _uniform(self, request_id: int, p: SamplingParams) -> float:
        """The next uniform in [0, 1) of the request's generator (seeded once, on the host)."""
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(p.seed if p.seed is not None else self.seed * 1_000_003 + request_id)
            self._generators[request_id] = gen
        return float(torch.rand(1, generator=gen))

    def forget(self, request_id: int) -> None:
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_id)


def _top_k(scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep each row's k highest scores (ties at the k-th kept); k = 0 keeps all."""
    if not any(k > 0 for k in ks):
        return scores
    v = scores.shape[1]
    kk = torch.tensor([min(k, v) if k > 0 else v for k in ks], device=scores.device)
    top = torch.topk(scores, int(kk.max()), dim=-1).values  # [R, kmax]
    kth = top.gather(1, (kk - 1)[:, None])  # [R, 1]
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Drop a token when the probability mass strictly before it already reaches the row's
    top_p; top_p = 1 keeps all."""
    if not any(p < 1.0 for p in top_ps):
        return scores
    limit = torch.tensor([p if p < 1.0 else float("inf") for p in top_ps], device=scores.device)
    sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
    probs = torch.softmax(sorted_scores, dim=-1)
    drop = (probs.cumsum(-1) - probs) >= limit[:, None]
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)
