"""Fitting the demo's routers from calibration hidden states (slow features + spherical k-means).

Every expert of the demo is the same FFN, so the router only decides *which* experts run, never
the output. It is built to route like a trained MoE tends to: tokens on a related topic share
experts. Per layer:

1. slow-feature projection P [hidden, rank]: the directions of the MoE input that change least
   from one token to the next within a document, relative to their overall second moment
   (generalized eigenvectors of the token-to-token difference covariance against the
   second-moment matrix, smallest eigenvalues first). Plain k-means on the raw states routes
   on mostly per-token features (consecutive-token reuse ~2.7x random on the demo prompts);
   on slow features it is ~5x random with balanced expert popularity.
2. spherical k-means (k-means++ seeding from a fixed seed, a few Lloyd iterations) of the
   normalized projected states y = normalize(P^T x) into num_experts unit centroids c_e.
3. router weight W = scale * C P^T, so logits = scale * c_e . (P^T x): the top-k experts are
   the centroids nearest in angle; scale makes the median top-1 logit margin over the mean
   about `margin`, so the softmax is peaked, not flat.

Covariances are summed in float32, the eigenproblem and k-means run in float64 on CPU from a
fixed seed: the same inputs give the same bytes.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from moetier.demo.calibration import MoEInputs

log = logging.getLogger(__name__)


def slow_projection(x: torch.Tensor, follows: torch.Tensor, rank: int) -> torch.Tensor:
    """[hidden, rank] projection onto the slowest-varying directions of x ([tokens, hidden])."""
    x = x.float()
    hidden = x.shape[1]
    second = (x.T @ x).double() / len(x)
    second += torch.eye(hidden, dtype=second.dtype) * (1e-6 * second.diagonal().mean())
    idx = follows.nonzero().squeeze(1)
    diff = x[idx] - x[idx - 1]
    diff_cov = (diff.T @ diff).double() / max(len(diff), 1)
    # D v = lambda S v with S = L L^T  <=>  (L^-1 D L^-T) u = lambda u,  v = L^-T u
    chol = torch.linalg.cholesky(second)
    left = torch.linalg.solve_triangular(chol, diff_cov, upper=False)
    reduced = torch.linalg.solve_triangular(chol, left.T, upper=False)
    _, vecs = torch.linalg.eigh((reduced + reduced.T) / 2)
    return torch.linalg.solve_triangular(chol.T, vecs[:, :rank], upper=True)


def kmeans_pp_init(y: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    first = int(torch.randint(len(y), (1,), generator=gen))
    centroids = [y[first]]
    for _ in range(k - 1):
        dist = (1.0 - y @ torch.stack(centroids).T).clamp_min(0).min(dim=1).values
        if float(dist.sum()) <= 0:
            dist = torch.ones_like(dist)
        centroids.append(y[int(torch.multinomial(dist, 1, generator=gen))])
    return torch.stack(centroids)


def spherical_kmeans(y: torch.Tensor, k: int, iters: int, seed: int) -> torch.Tensor:
    """k unit centroids of the unit rows of y; an emptied cluster keeps its old centroid."""
    gen = torch.Generator().manual_seed(seed)
    centroids = kmeans_pp_init(y, k, gen)
    for _ in range(iters):
        assign = (y @ centroids.T).argmax(dim=1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, y)
        counts = torch.bincount(assign, minlength=k)
        updated = torch.nn.functional.normalize(sums, dim=1)
        centroids = torch.where(counts[:, None] > 0, updated, centroids)
    return centroids


def fit_router(
    x: torch.Tensor,
    follows: torch.Tensor,
    num_experts: int,
    rank: int = 128,
    iters: int = 10,
    seed: int = 0,
    margin: float = 4.0,
) -> torch.Tensor:
    """Router weight [num_experts, hidden] (float32) for one layer's MoE inputs x."""
    proj = slow_projection(x, follows, min(rank, x.shape[1]))
    z = x.double() @ proj
    y = torch.nn.functional.normalize(z, dim=1)
    centroids = spherical_kmeans(y, num_experts, iters, seed)
    logits = z @ centroids.T
    gap = (logits.max(dim=1).values - logits.mean(dim=1)).median().clamp_min(1e-12)
    return (margin / gap * centroids @ proj.T).float()


def fit_routers(
    inputs: MoEInputs, num_experts: int, seed: int = 0, progress: bool = True
) -> list[torch.Tensor]:
    """One router weight per layer; layer l uses seed + l."""
    layers = range(inputs.hidden.shape[0])
    return [
        fit_router(inputs.hidden[i], inputs.follows_previous, num_experts, seed=seed + i)
        for i in tqdm(layers, desc="fitting routers", unit="layer", disable=not progress)
    ]
