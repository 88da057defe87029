"""Every family through `moetier serve`: concurrent greedy completions of mixed prompt lengths,
on a KV pool too small for them all (the scheduler preempts and recomputes) and a step budget
below the longest prompt (its prefill is chunked), at a 50% expert budget, return exactly
transformers' greedy tokens for each prompt alone; afterwards nothing runs or waits and no KV
block is held (/health?check=true also checks the KV and expert-slot integrity).

The parametrization id is the family key (tests/models/families.py): scripts/compat_matrix.py
reads these cases as its "server (concurrent, preempted)" column."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from tests.models.families import FAMILIES
from tests.models.parity import hf_greedy, hf_model
from tests.server.conftest import (
    LiveServer,
    launch_server,
    stop_server,
    wait_idle,
    wait_until_up,
)
from tests.server.tiny import VOCAB, save_byte_tokenizer

NEW = 10
BLOCK = 8
STEP_TOKENS = 64
_rng = random.Random(7)
# 70 tokens > STEP_TOKENS: chunked prefill; 30, 21 and 13 span several KV blocks, 6 and 3 fit
# in one.
PROMPTS: list[list[int]] = [
    [_rng.randrange(0, 256) for _ in range(70)],
    [_rng.randrange(0, 256) for _ in range(30)],
    [_rng.randrange(0, 256) for _ in range(21)],
    [200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 250, 17],
    [1, 5, 9, 33, 100, 7],
    [7, 8, 9],
]
# 10 blocks of 8 tokens = 80 token slots: the longest request (70 + 10 tokens) just fits alone;
# beside it any other request runs out of blocks, and the five others together need 16 blocks,
# so in whatever order the requests reach the engine (all within its first steps: see
# _complete_all), the newest running ones are preempted.
KV_BLOCKS = 10
CRAMPED = (
    "--expert-budget", "50%", "--max-num-seqs", "8", "--num-kv-blocks", str(KV_BLOCKS),
    "--kv-block-size", str(BLOCK), "--max-num-batched-tokens", str(STEP_TOKENS),
)  # fmt: skip


async def _complete_all(server: LiveServer) -> list[list[int]]:
    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = dict(model=server.model, prompt=prompt, max_tokens=NEW, temperature=0,
                    ignore_eos=True, return_token_ids=True)  # fmt: skip
        r = await client.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient() as client:
        # A first request sets the client up (lazy imports, first connection): without it
        # the first completion reached the engine ~20 ms before the others and could finish
        # alone. Now all arrive within a few ms, inside the engine's first steps.
        assert (await client.get(f"{server.url}/v1/models")).status_code == 200
        return list(await asyncio.gather(*(one(client, p) for p in PROMPTS)))


def check_served(family: str, tmp_path: Path, *extra: str) -> None:
    """`moetier serve` of the family's checkpoint with CRAMPED (and `extra`) settings answers
    every PROMPTS completion with transformers' greedy tokens, preempting, and ends idle."""
    path = FAMILIES[family].checkpoint(tmp_path / family, vocab_size=VOCAB)
    save_byte_tokenizer(path)
    server = launch_server(path, tmp_path / "server.log", *CRAMPED, *extra)
    try:
        ref = hf_model(path)  # while the server loads
        want = [hf_greedy(ref, p, NEW) for p in PROMPTS]
        del ref
        wait_until_up(server)
        got = asyncio.run(_complete_all(server))
        for prompt, tokens, expected in zip(PROMPTS, got, want):
            assert tokens == expected, f"token mismatch for the {len(prompt)}-token prompt"
        health = wait_idle(server)
        assert health["status"] == "ok" and health["kv_blocks_used"] == 0, health
        assert health["kv_blocks_total"] == KV_BLOCKS, health
        assert health["num_preemptions"] > 0, health  # the cramped pool did preempt
    finally:
        code = stop_server(server)
    assert code == 0, server.log()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_concurrent_preempted_equal_transformers(family: str, tmp_path: Path) -> None:
    check_served(family, tmp_path)
