"""Demo variants without building one: names, sizes, perturbation, router fit, build plumbing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moetier.demo import builder, router_fit, upcycle, verify
from moetier.demo.shards import INDEX_NAME, LazyTensor, write_sharded
from moetier.demo.variants import DEFAULT_SPEC, DemoSpec
from moetier.errors import MoetierError


def test_spec_names_and_sizes() -> None:
    assert DEFAULT_SPEC.name == builder.DEMO_NAME == "smollm2-moe-16x2"
    assert DemoSpec(128, 8).name == "smollm2-moe-128x8"
    assert DemoSpec(64, 6, 0.01, 3).name == "smollm2-moe-64x6-p0.01-s3"
    assert DemoSpec(16, 2, 0.0, 0).is_default and not DemoSpec(16, 2, 0.5).is_default
    # the 16x2 build's index says 2,658,370,176 bytes; each expert is 3 x 576 x 1536 bf16
    assert DEFAULT_SPEC.checkpoint_bytes == 2_658_370_176
    assert DemoSpec(128, 8).expert_bytes == 5_308_416
    big = DemoSpec(128, 8).checkpoint_bytes
    assert big - DEFAULT_SPEC.checkpoint_bytes == 30 * 112 * (5_308_416 + 576 * 2)
    assert 20.4e9 < big < 20.6e9


@pytest.mark.parametrize(
    ("args", "flag"),
    [((0, 1), "--experts"), ((8, 9), "--top-k"), ((8, 0), "--top-k"), ((8, 2, -1.0), "--perturb")],
)
def test_spec_rejects_bad_settings(args: tuple, flag: str) -> None:
    with pytest.raises(MoetierError, match=flag):
        DemoSpec(*args)


def test_variant_directory_and_disk_space_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = DemoSpec(128, 8)
    assert builder.demo_model_dir(tmp_path, spec) == tmp_path / "demo" / "smollm2-moe-128x8"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: usage._replace(free=5 * 10**9))
    with pytest.raises(MoetierError, match=r"about 20\.8 GB .* only 5\.0 GB free.*MOETIER_HOME"):
        builder.ensure_demo_model(tmp_path, progress=False, spec=spec)


def test_variant_build_goes_to_its_own_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[DemoSpec] = []

    def fake_build(root: Path, out: Path, progress: bool, spec: DemoSpec) -> None:
        out.mkdir(parents=True)
        for name in ("config.json", INDEX_NAME):
            (out / name).write_text("{}")
        (out / builder.INFO_NAME).write_text(json.dumps({"recipe_version": 1}))
        seen.append(spec)

    monkeypatch.setattr(builder, "build_demo_model", fake_build)
    spec = DemoSpec(4, 2, 0.1, 7)
    path = builder.ensure_demo_model(tmp_path, progress=False, spec=spec)
    assert path == tmp_path / "demo" / "smollm2-moe-4x2-p0.1-s7" and seen == [spec]
    assert not builder.is_complete(builder.demo_model_dir(tmp_path))  # the default is apart


def test_perturbation_is_seeded_exact_and_relative() -> None:
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16)
    a = upcycle.perturbed(base, 0.05, seed=11, dtype=torch.bfloat16)
    assert torch.equal(a, upcycle.perturbed(base, 0.05, seed=11, dtype=torch.bfloat16))
    assert not torch.equal(a, upcycle.perturbed(base, 0.05, seed=12, dtype=torch.bfloat16))
    rel = (a.float() - base.float()).pow(2).mean().sqrt() / base.float().pow(2).mean().sqrt()
    assert 0.04 < float(rel) < 0.06
    seeds = {
        upcycle.noise_seed(s, la, e, t)
        for s in (0, 1)
        for la in (0, 29)
        for e in range(128)
        for t in range(3)
    }
    assert len(seeds) == 2 * 2 * 128 * 3


def _tiny_state(layers: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(10, 4, generator=gen)}
    for la in range(layers):
        state[f"model.layers.{la}.input_layernorm.weight"] = torch.ones(4)
        for name, shape in (("gate_proj", (6, 4)), ("up_proj", (6, 4)), ("down_proj", (4, 6))):
            state[f"model.layers.{la}.mlp.{name}.weight"] = torch.randn(shape, generator=gen)
    state["model.norm.weight"] = torch.ones(4)
    return state


def test_upcycled_entries_perturbed_are_lazy_distinct_and_deterministic(tmp_path: Path) -> None:
    state = _tiny_state()
    routers = [torch.randn(3, 4), torch.randn(3, 4)]
    plain = upcycle.upcycled_entries(state, routers, 3, True)
    experts = [t for n, t in plain if ".experts." in n]
    assert len(experts) == 2 * 3 * 3 and all(isinstance(t, torch.Tensor) for t in experts)
    lazy = upcycle.upcycled_entries(state, routers, 3, True, perturb=0.1, seed=5)
    assert [n for n, _ in lazy] == [n for n, _ in plain]
    assert all(isinstance(t, LazyTensor) for n, t in lazy if ".experts." in n)
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        write_sharded(tmp_path / sub, lazy, 1 << 20, progress=False)
    shard = "model-00001-of-00001.safetensors"
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    with safe_open(str(tmp_path / "a" / shard), "pt") as f:
        w = [f.get_tensor(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight") for e in (0, 1)]
        dense = state["model.layers.1.mlp.gate_proj.weight"].to(torch.bfloat16)
        seed = upcycle.noise_seed(5, 1, 0, 0)
        assert torch.equal(w[0], upcycle.perturbed(dense, 0.1, seed, torch.bfloat16))
        assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], dense)


def test_router_fit_with_many_centroids_uses_them() -> None:
    gen = torch.Generator().manual_seed(0)
    topics = torch.randn(32, 24, generator=gen) * 3
    x = torch.cat([t + torch.randn(30, 24, generator=gen) for t in topics])
    follows = torch.ones(len(x), dtype=torch.bool)
    follows[::30] = False
    w = router_fit.fit_router(x, follows, num_experts=32, rank=16, seed=1)
    assert w.shape == (32, 24)
    assert torch.equal(w, router_fit.fit_router(x, follows, num_experts=32, rank=16, seed=1))
    top1 = (x @ w.T).argmax(dim=1)
    assert len(set(top1.tolist())) >= 24  # most of the 32 centroids get tokens
    top4 = (x @ w.T).topk(4, dim=1).indices
    assert top4.shape == (len(x), 4)


def test_mixtral_config_carries_expert_count_and_top_k() -> None:
    from transformers import LlamaConfig

    dense = LlamaConfig(
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    cfg = upcycle.mixtral_config(dense, 128, 8, "bfloat16")
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (128, 8)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4, 6, 2)


def test_check_index_names_what_is_missing(tmp_path: Path) -> None:
    state = _tiny_state()
    entries = upcycle.upcycled_entries(state, [torch.randn(3, 4)] * 2, 3, True)
    write_sharded(tmp_path, entries, 1 << 20, progress=False)
    config = {"num_local_experts": 3, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    verify.check_index(tmp_path, 3, 2)
    with pytest.raises(RuntimeError, match="experts, top-k"):
        verify.check_index(tmp_path, 4, 2)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    del index["weight_map"]["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(RuntimeError, match="experts.2.w3"):
        verify.check_index(tmp_path, 3, 2)


def test_cli_build_demo_prints_the_size_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from moetier.cli import main

    built: list[DemoSpec] = []

    def fake_ensure(home: object = None, progress: bool = True, spec: DemoSpec = DEFAULT_SPEC):
        built.append(spec)
        return tmp_path / spec.name

    monkeypatch.setenv("MOETIER_HOME", str(tmp_path))
    monkeypatch.setattr(builder, "ensure_demo_model", fake_ensure)
    assert main(["build-demo", "--experts", "128", "--top-k", "8", "--perturb", "0.01"]) == 0
    out, err = capsys.readouterr()
    assert built == [DemoSpec(128, 8, 0.01)]
    assert out.strip() == str(tmp_path / "smollm2-moe-128x8-p0.01")
    assert "20.5 GB" in err and "128 experts" in err
    assert main(["build-demo", "--experts", "8", "--top-k", "9"]) == 2
    assert "--top-k must be 1..experts (8)" in capsys.readouterr().err
