"""Sampler: greedy argmax, top-k/top-p masks, and seeded determinism independent of batching."""

import torch

from moetier.core import SamplingParams
from moetier.engine.sampler import Sampler


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert Sampler().sample(logits, [0, 1], [SamplingParams(temperature=0)] * 2) == [1, 0]


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(4)]
    assert Sampler().sample(logits, [0, 1, 2, 3], params) == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_head() -> None:
    # probabilities ~ [0.88, 0.12, ~0]: top_p 0.5 keeps only token 0
    logits = torch.tensor([[4.0, 2.0, -10.0]])
    got = {Sampler().sample(logits, [i], [SamplingParams(top_p=0.5, seed=i)])[0] for i in range(20)}
    assert got == {0}


def test_seeded_sampling_repeats_and_ignores_batch_mates() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=4)
    alone = [Sampler().sample(logits, [7], [p])[0] for _ in range(3)]
    batched = Sampler().sample(torch.zeros(2, 1000), [7, 8], [p, SamplingParams(seed=1)])
    assert alone[0] == alone[1] == alone[2] == batched[0]


def test_batched_rows_sample_their_own_distribution() -> None:
    # row 0 may only pick tokens 2 or 5; row 1 only token 7 (top_k 1); row 2 greedy
    logits = torch.full((3, 10), -30.0)
    logits[0, 2], logits[0, 5] = 1.0, 1.0
    logits[1, 7], logits[1, 3] = 2.0, 1.9
    logits[2, 4] = 3.0
    seen = set()
    for seed in range(40):
        params = [
            SamplingParams(temperature=1.0, seed=seed),
            SamplingParams(temperature=0.7, top_k=1, seed=seed),
            SamplingParams(temperature=0),
        ]
        a, b, c = Sampler().sample(logits, [0, 1, 2], params)
        seen.add(a)
        assert b == 7 and c == 4
    assert seen == {2, 5}  # both, and nothing of probability ~0
