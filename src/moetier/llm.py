"""Offline facade: LLM(model, ...).generate(prompts, params), vLLM-shaped.

Owns tokenization of string prompts and the run-to-completion loop; the engine does the rest.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetier.config import (
    DEFAULT_MAX_NUM_SEQS,
    Budget,
    CacheConfig,
    EngineConfig,
    MemoryConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_budget,
)
from moetier.core import RequestOutput, SamplingParams
from moetier.engine.engine import Engine
from moetier.errors import CheckpointError, ConfigError, DeviceMemoryError
from moetier.parallel.group import torchrun_rank
from moetier.parallel.launch import Workers, rank_config, start_group
from moetier.threads import check_threads

if TYPE_CHECKING:
    from moetier.tools.support import ToolSupport

log = logging.getLogger(__name__)

Prompt = str | list[int]


def load_tokenizer(model_dir: str | Path, tokenizer: str | Path | None = None) -> Any | None:
    """The checkpoint's tokenizer through transformers (a GGUF file's from its metadata), or
    None when it has none; a CheckpointError for a GGUF file whose tokenizer transformers
    would build wrong (weights/gguf_deepseek.py's check_tokenizer). `tokenizer`: a Hugging
    Face tokenizer (directory or hub name) used instead; a ConfigError where it cannot load."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        try:
            return AutoTokenizer.from_pretrained(str(tokenizer))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"tokenizer {tokenizer}: transformers cannot load it ({reason}); pass a Hugging "
                f"Face tokenizer directory (tokenizer.json or its vocabulary files) or hub name"
            ) from None

    from moetier.weights import gguf_deepseek
    from moetier.weights.gguf import gguf_architecture, is_gguf

    try:
        if is_gguf(model_dir):  # the tokenizer and chat template are in the file's metadata
            path = Path(model_dir)
            if not path.is_file():
                return None  # the engine's load names the missing file
            arch = gguf_architecture(path)
            if arch in gguf_deepseek.ARCHS:  # glm4moe, deepseek2: as gpt-oss, once checked
                gguf_deepseek.check_tokenizer(path)
            if arch in ("gpt-oss", "qwen3next", "olmoe", "gemma4", "llama4") or (
                arch in gguf_deepseek.ARCHS
            ):
                # AutoTokenizer first reads the file's config through transformers' GGUF
                # mapping, which fails on gpt-oss's rope.scaling keys and gemma4's per-layer
                # KV heads and knows no qwen3next, olmoe, glm4moe, deepseek2 or llama4; the
                # tokenizers backend builds from the file alone (vocabulary, merges and
                # llama.cpp's pre-tokenizer name: "qwen2" for Qwen3-Next, "llama4" for Llama 4,
                # which transformers splits with GPT-4o's pattern as llama.cpp does).
                from transformers import PreTrainedTokenizerFast

                return PreTrainedTokenizerFast.from_pretrained(
                    str(path.parent), gguf_file=path.name
                )
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("no usable tokenizer in %s (%s); prompts must be token ids", model_dir, reason)
        return None


def load_tokenizer_or_reason(
    model_dir: str | Path, tokenizer: str | Path | None = None
) -> tuple[Any | None, CheckpointError | None]:
    """`load_tokenizer`, with its CheckpointError (a tokenizer the file's metadata would build
    wrong) logged and returned instead: the model still runs on token ids."""
    try:
        return load_tokenizer(model_dir, tokenizer), None
    except CheckpointError as exc:
        log.warning("%s", exc)
        return None, exc


def _check_budgets_and_policy(
    expert_budget: Budget, host_budget: Budget, policy: str, prefetch: str | None = None
) -> None:
    """Budget syntax, the policy and predictor names, before the checkpoint is read (sizes come
    later)."""
    from moetier.offload.policy import POLICIES
    from moetier.offload.predict import PREDICTORS

    parse_budget(expert_budget, 0, "expert budget")
    parse_budget(host_budget, 0, "host budget")
    if policy not in POLICIES:
        raise ConfigError(
            f"unknown expert-cache policy {policy!r}; choose one of {', '.join(sorted(POLICIES))}"
        )
    if prefetch is not None and prefetch not in PREDICTORS:
        raise ConfigError(
            f"unknown prefetch predictor {prefetch!r}; choose one of "
            f"{', '.join(sorted(PREDICTORS))} (or leave prefetch off)"
        )


def _leave_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _close_group(runner: Any, workers: Workers) -> None:
    """Rank 0: stop the other ranks (they exit on "stop"; killed after a timeout), leave."""
    if runner.parallel is not None:
        runner.parallel.close()
    workers.stop()
    _leave_group()


def _build_engine(config: EngineConfig, tokenizer: Any) -> Engine:
    """The engine; a device out-of-memory not already explained where it happened (non-expert
    weights, expert slots) becomes a DeviceMemoryError naming the settings that use memory."""
    try:
        return Engine(config, tokenizer)
    except torch.OutOfMemoryError as exc:
        detail = ". ".join(str(exc).strip().split(". ")[:2])
    # Raised outside `except`: chaining would keep the half-built engine's tensors alive.
    raise DeviceMemoryError(
        f"device out of memory while building the engine ({detail}). Lower "
        f"--expert-budget (now {config.offload.expert_budget or 'all experts'}), "
        f"--num-kv-blocks or --max-num-seqs (or --kv-cache-dtype int8), or free the memory "
        f"other processes hold."
    )


class LLM:
    """Load a Hugging Face MoE checkpoint with tiered experts and generate from prompts."""

    def __init__(
        self,
        model: str | Path | None = None,
        expert_budget: Budget = None,
        host_budget: Budget = None,
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        policy: str = "lru",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 4096,
        progress: bool = True,
        moe_grouped_kernel: bool | None = None,
        moe_mxfp4_kernel: bool = True,
        moe_stream_share: float | None = None,
        moe_slot_kernel_max_pairs: int | None = None,
        fused_kernels: bool | None = None,
        cuda_graphs: bool | None = None,
        piecewise_graphs: bool | None = None,
        prefill_graphs: bool | None = None,
        prefill_graph_max_tokens: int = 512,
        num_kv_blocks: int | None = None,
        kv_block_size: int = 16,
        max_model_len: int | None = None,
        prefetch: str | None = None,
        prefetch_ahead: int = 1,
        threads: int | None = None,
        late_reads: bool = True,
        device_cache: bool = False,
        stream_eviction: bool = OffloadConfig.stream_eviction,
        transfer_window: int = 1,
        stream_copy_now: bool = OffloadConfig.stream_copy_now,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        gpu_memory: Budget = None,
        routing_trace: str | Path | None = None,
        expert_parallel_size: int = 1,
        expert_placement: str = "round-robin",
        placement_trace: str | Path | None = None,
        parallel_timeout_s: float = 300.0,
        tokenizer: str | Path | None = None,
    ) -> None:
        """`gpu_memory`: one device budget ("24GiB", "90%") split between non-expert weights, a
        reserve, expert slots and KV blocks (engine/memory_split.py); `routing_trace`: a
        moetier-trace file whose replayed hit rates size that split when `max_num_seqs` is
        not given (None = 64 sequences, and the split may hold fewer). `stream_eviction`:
        streamed steps (long prefills, big batches; `moe_stream_share`) evict in the step's
        next-use order around `policy` (offload/step_aware.py); False = `policy` alone.
        `transfer_window`: prefetch chunks on the CUDA copy stream at once (a miss waits
        behind that many). `stream_copy_now`: a streamed step's next-layer loads go on the copy
        stream at once, whole, not through the pump thread.
        `expert_parallel_size`: routed experts spread over this many ranks, one process each
        (this one is rank 0; the others start here, or under torchrun), each rank's budgets
        its own; `expert_placement` "round-robin" or "balanced" (by use in `placement_trace`);
        `parallel_timeout_s`: how long a rank waits for the others before the group is given
        up. `close()` stops the other ranks."""
        # Every setting is checked before any work (the demo build, the checkpoint load).
        seqs = DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
        scheduler = SchedulerConfig(seqs, max_num_batched_tokens)
        trace = None if routing_trace is None else str(routing_trace)
        memory = MemoryConfig(gpu_memory, trace, seqs_fixed=max_num_seqs is not None)
        if trace is not None and not Path(trace).is_file():
            raise ConfigError(f"routing trace {trace}: no such file")
        cache = CacheConfig(
            kv_block_size,
            num_kv_blocks,
            None,
            max_model_len,
            enable_prefix_caching,
            kv_cache_dtype,
        )
        _check_budgets_and_policy(expert_budget, host_budget, policy, prefetch)
        threads = check_threads(threads)
        offload = OffloadConfig(
            expert_budget,
            host_budget,
            policy,
            prefetch=prefetch,
            prefetch_ahead=prefetch_ahead,
            late_reads=late_reads,
            device_cache=device_cache,
            stream_eviction=stream_eviction,
            transfer_window=transfer_window,
            stream_copy_now=stream_copy_now,
        )
        parallel = ParallelConfig(
            expert_parallel_size,
            expert_placement,
            None if placement_trace is None else str(placement_trace),
            parallel_timeout_s,
        )
        if model is None:
            from moetier.demo.builder import ensure_demo_model

            model = ensure_demo_model(progress=progress)
        self.config = EngineConfig(
            model=str(model),
            device=device,
            dtype=dtype,
            seed=seed,
            offload=offload,
            scheduler=scheduler,
            cache=cache,
            memory=memory,
            parallel=parallel,
            progress=progress,
            moe_grouped_kernel=moe_grouped_kernel,
            moe_mxfp4_kernel=moe_mxfp4_kernel,
            moe_stream_share=moe_stream_share,
            moe_slot_kernel_max_pairs=moe_slot_kernel_max_pairs,
            fused_kernels=fused_kernels,
            cuda_graphs=cuda_graphs,
            piecewise_graphs=piecewise_graphs,
            prefill_graphs=prefill_graphs,
            prefill_graph_max_tokens=prefill_graph_max_tokens,
            threads=threads,
        )
        follower = torchrun_rank()
        if self.config.parallel.expert_parallel_size > 1 and follower not in (None, 0):
            # a rank other than 0 that torchrun started: follow rank 0, then end the process
            from moetier.parallel.worker import run_worker

            with torch.inference_mode():
                raise SystemExit(run_worker(self.config))
        self.tokenizer, self._tokenizer_error = load_tokenizer_or_reason(model, tokenizer)
        self._workers = start_group(self.config)
        if self._workers is not None:
            self.config = rank_config(self.config, 0)
            try:
                self.engine = _build_engine(self.config, self.tokenizer)
            except BaseException:
                self._workers.stop(0.0 if torch.distributed.is_initialized() else 10.0)
                _leave_group()
                raise
            self._workers.check_ready(self.engine.runner.parallel)
            self._closer = weakref.finalize(self, _close_group, self.engine.runner, self._workers)
        else:
            self.engine = _build_engine(self.config, self.tokenizer)
        self._tool_supports: dict[str | None, ToolSupport] = {}  # by format name, made on use

    def close(self) -> None:
        """Stop the other ranks of an expert-parallel group (nothing for one rank); the LLM
        cannot generate after it."""
        if self._workers is not None:
            self._closer()

    def parallel_failure(self) -> str | None:
        """Why the expert-parallel group can no longer run steps (naming the rank that exited,
        when this process started it), or None while it can (always None for one rank)."""
        parallel = self.engine.runner.parallel
        if parallel is None or parallel.broken is None:
            return None
        assert self._workers is not None
        time.sleep(0.2)  # a rank that just died: let its exit be seen
        dead = self._workers.why_dead()
        return parallel.broken if dead is None else f"{dead}; {parallel.broken}"

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None and self._tokenizer_error is not None:
                raise CheckpointError(str(self._tokenizer_error))
            if self.tokenizer is None:
                raise ConfigError(
                    "this checkpoint has no tokenizer: pass prompts as token id lists"
                )
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ConfigError("a prompt must be a string or a list of token ids")
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together as one batch; one RequestOutput per prompt, in order."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams, got {type(params).__name__}")
        batch: list[Prompt] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        # Encode and check every prompt before queueing any, so a bad one leaves nothing behind.
        encoded = [self._encode(p) for p in batch]
        for ids in encoded:
            self.engine.check_prompt(ids, params)
        requests = [
            self.engine.add_request(ids, params, p if isinstance(p, str) else None)
            for p, ids in zip(batch, encoded)
        ]
        mine = {r.request_id for r in requests}
        while self.engine.has_unfinished():
            failed = [d for d in self.engine.step() if d.error is not None and d.request_id in mine]
            if failed:
                # The engine stays usable: abort this call's other requests, then report.
                for r in requests:
                    self.engine.abort(r.request_id)
                self.engine.step()
                raise RuntimeError(f"generation failed: {failed[0].error}") from (
                    self.engine.last_error
                )
        return [self.engine.to_output(r) for r in requests]

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_parser: str | None = None,
    ) -> RequestOutput:
        """Apply the checkpoint's chat template to `messages` and generate one reply.

        `tools` (OpenAI function tools) and `tool_choice` ("auto", the default; "none";
        "required"; or {"type": "function", "function": {"name": ...}}) work as in the
        server's chat completions: the template renders the tools, required or named choices
        force one call through a grammar, and the reply's `outputs[0].tool_calls` holds the
        parsed calls (`content`: the text before them, or the whole text when no call).
        `tool_parser` names the format when the template's is not detected (the server's
        --tool-call-parser)."""
        from moetier.tools.support import ToolError

        if self.tokenizer is None and self._tokenizer_error is not None:
            raise CheckpointError(str(self._tokenizer_error))
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("this checkpoint has no chat template; use generate() with a prompt")
        support = self._tool_support(tool_parser)
        try:
            plan, rendered = support.plan(tools, tool_choice, parallel_tool_calls)
        except ToolError as exc:
            raise ConfigError(f"{exc.param}: {exc}") from exc
        params = params or SamplingParams()
        if plan.forced is not None:
            if params.structured is not None:
                raise ConfigError(
                    "params.structured cannot be combined with a forced tool call "
                    "(tool_choice required or a named function)"
                )
            params = replace(params, structured=plan.forced)
        if plan.parser is not None and plan.parser.keeps_special_tokens:
            params = replace(params, skip_special_tokens=False)
        ids = support.render(messages, rendered)
        out = self.generate([ids], params)[0]
        for c in out.outputs:
            c.content, c.tool_calls = plan.calls(c.text)
            c.reasoning = plan.reasoning(c.text)
        return out

    def _tool_support(self, parser: str | None) -> ToolSupport:
        """The tokenizer's tool support for a format name (None: detected), made once."""
        from moetier.tools.parsers import get_tool_parser
        from moetier.tools.support import ToolSupport

        if parser is not None:
            try:
                get_tool_parser(parser)
            except KeyError as exc:
                raise ConfigError(str(exc.args[0])) from exc
        if parser not in self._tool_supports:
            self._tool_supports[parser] = ToolSupport(self.tokenizer, parser)
        return self._tool_supports[parser]

    @torch.inference_mode()
    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """Float32 logits [V] at the last prompt position (for parity checks); leaves no state."""
        from moetier.core import Request
        from moetier.engine.batch import ScheduledRequest, SchedulerOutput

        ids = self._encode(prompt)
        req = Request(-1, ids, SamplingParams(max_tokens=1))
        try:
            logits = self.engine.runner.execute(SchedulerOutput([ScheduledRequest(req, len(ids))]))
        finally:
            self.engine.runner.free(-1)
            self.engine.runner.end_request(-1)
        return logits[0].cpu()

    def reset_prefix_cache(self) -> int:
        """Drop the KV prefix cache (do it after changing the model's weights or routing, which
        changes the K/V a prompt would get); the number of cached blocks dropped."""
        return self.engine.blocks.reset_prefix_cache()

    def offload_stats(self) -> dict[str, Any]:
        """Counters of the expert tiers (hits by tier, bytes moved, exposed fetch time), of the
        KV prefix cache (tokens looked up and reused at admission) and the KV cache's effective
        storage format (`kv_cache_dtype`, a name), the experts' storage format (`expert_format`,
        a name: bf16, fp8_e4m3, ...; `expert_bytes` is one packed expert as stored), and the
        memory split (`gpu_memory_bytes`, `split_expert_bytes`, `split_kv_bytes`,
        `split_reason`, a name); the rest are numbers."""
        stats: dict[str, Any] = dict(self.engine.runner.stats.to_dict())
        kv = self.engine.runner.kv_cache
        plan = self.engine.runner.tier_plan
        sched = self.engine.scheduler
        stats.update(
            device_slots=plan.device_slots,
            host_rows=plan.host_rows,
            total_experts=plan.total_experts,
            expert_bytes=plan.expert_bytes,
            expert_format=self.engine.runner.expert_cache.packing.name,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            kv_cache_dtype=kv.format.name,
            kv_bytes_per_token=kv.bytes_per_token,
            kv_cache_bytes=kv.bytes(),
            kv_blocks_total=kv.blocks.num_blocks,
            **self.engine.runner.memory_split.stats(),
        )
        parallel = self.engine.runner.parallel
        if parallel is not None:
            stats["expert_parallel_size"] = parallel.world
            stats.update(parallel.stats.to_dict())
            stats["ranks"] = self.rank_stats()
        return stats

    def rank_stats(self) -> list[dict[str, Any]]:
        """Per rank of an expert-parallel group (rank 0 first): the experts it owns, its
        slots, its tier counters (hits, bytes over its link, exposed fetch) and its collective
        time; [] for one rank."""
        return self.engine.runner.all_rank_stats()
