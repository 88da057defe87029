"""The `moetier generate` command on a checkpoint the tests build (with a tiny tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier import LLM, SamplingParams
from moetier.cli import main
from tests.models.parity import add_tokenizer, make_checkpoint

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("cli"), "mixtral", **TINY)
    add_tokenizer(path)
    return path


def test_generate_prints_text_and_summary(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(ckpt),
            "--prompt",
            "Hello world",
            "--max-tokens",
            "6",
            "--expert-budget",
            "50%",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    out, err = capsys.readouterr()
    llm = LLM(str(ckpt), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    ref = llm.generate("Hello world", SamplingParams(max_tokens=6, temperature=0))[0]
    assert out == ref.outputs[0].text + "\n"
    assert "[moetier] 6 tokens in" in err and "4/8 slots" in err and "exposed fetch" in err


def test_generate_bad_budget_exits_2(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(ckpt), "--expert-budget", "ten", "--device", "cpu"])
    assert rc == 2
    assert "moetier: error: expert budget: cannot parse 'ten'" in capsys.readouterr().err


def test_stop_string_cuts_text(ckpt: Path) -> None:
    llm = LLM(str(ckpt), device="cpu", dtype="float32", progress=False)
    full = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert cut.outputs[0].text == text[: text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop"


def test_prefix_caching_flag_reaches_the_engine() -> None:
    from moetier.cli import build_parser
    from moetier.server.cli import _engine_args

    p = build_parser()
    assert p.parse_args(["generate"]).enable_prefix_caching is True
    assert p.parse_args(["generate", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert _engine_args(p.parse_args(["serve"])).enable_prefix_caching is True
    off = _engine_args(p.parse_args(["serve", "--no-enable-prefix-caching"]))
    assert off.enable_prefix_caching is False


@pytest.mark.parametrize("name", ["stream_eviction", "stream_copy_now"])
def test_stream_flags_default_on_and_turn_off(name: str) -> None:
    """Streamed steps evict in the step's order and copy at once unless told not to (the H100
    gates of 2026-12-07), through generate, serve and LLM alike."""
    import inspect

    from moetier import LLM
    from moetier.cli import build_parser
    from moetier.server.cli import _engine_args

    flag = "--no-" + name.replace("_", "-")
    p = build_parser()
    assert getattr(p.parse_args(["generate"]), name) is True
    assert getattr(p.parse_args(["generate", flag]), name) is False
    assert getattr(_engine_args(p.parse_args(["serve"])), name) is True
    assert getattr(_engine_args(p.parse_args(["serve", flag])), name) is False
    assert inspect.signature(LLM).parameters[name].default is True


def test_tokenizer_flag_reaches_the_engine() -> None:
    from moetier.cli import build_parser
    from moetier.server.cli import _engine_args

    p = build_parser()
    assert p.parse_args(["generate"]).tokenizer is None
    assert p.parse_args(["generate", "--tokenizer", "tok"]).tokenizer == "tok"
    assert _engine_args(p.parse_args(["serve"])).tokenizer is None
    assert _engine_args(p.parse_args(["serve", "m.gguf", "--tokenizer", "tok"])).tokenizer == "tok"


def test_kv_cache_dtype_flag_reaches_the_engine(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moetier.bench.cli import latency_settings
    from moetier.cli import build_parser
    from moetier.server.cli import _engine_args

    p = build_parser()
    assert p.parse_args(["generate"]).kv_cache_dtype == "auto"
    assert (
        _engine_args(p.parse_args(["serve", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    )
    bench = latency_settings(p.parse_args(["bench", "latency", "--kv-cache-dtype", "fp16"]))
    assert bench.llm_kwargs["kv_cache_dtype"] == "fp16"
    assert "kv_cache_dtype" not in latency_settings(p.parse_args(["bench", "latency"])).llm_kwargs
    assert p.parse_args(["generate", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert _engine_args(p.parse_args(["serve", "--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--kv-cache-dtype", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    rc = main(["generate", "--model", str(ckpt), "--prompt", "Hi", "--max-tokens", "2",
               "--device", "cpu", "--dtype", "float32", "--kv-cache-dtype", "int8"])  # fmt: skip
    assert rc == 0
