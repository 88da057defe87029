"""The engine: owns scheduler, runner, sampler and tokenizer; one step = schedule, run, update.

Knows nothing of HTTP or tensors' layout inside the model. A step that raises fails only that
step's requests (their blocks freed) and leaves the engine serving.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from moetier.config import EngineConfig
from moetier.core import CompletionOutput, Request, RequestOutput, SamplingParams
from moetier.engine.batch import ScheduledRequest, SchedulerOutput
from moetier.engine.model_runner import ModelRunner, resolve_device
from moetier.engine.outputs import RequestDelta, TokenLogprob
from moetier.engine.sampler import Sampler
from moetier.engine.scheduler import Scheduler
from moetier.engine.stopping import StopChecker
from moetier.engine.structured import GrammarMasks, compile_grammar
from moetier.errors import ConfigError
from moetier.threads import configure_threads

log = logging.getLogger(__name__)


# Per-rank counters of an expert-parallel group in `Engine.stats` ("rank{r}.{key}"; /metrics
# exports them with a `rank` label: metrics.py).
RANK_METRIC_KEYS = (
    "device_hits", "host_hits", "disk_reads", "bytes_host_to_device", "bytes_disk_to_host",
    "exposed_fetch_s", "collective_calls", "collective_s", "collective_bytes", "owned_experts",
    "device_slots",
)  # fmt: skip


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        # Before the load: reading and converting the checkpoint already runs on these threads.
        self.threads = configure_threads(config.threads, resolve_device(config.device))
        self.runner = ModelRunner(config)
        self.tokenizer = tokenizer
        self.blocks = self.runner.kv_cache.blocks
        states = self.runner.state_cache
        self.scheduler = Scheduler(
            config.scheduler, self.blocks, states.slots if states is not None else None
        )
        self.stopping = StopChecker(tokenizer, self.runner.hf_config, self.runner.generation_config)
        self._ids = itertools.count()
        self.vocab_size = int(self.runner.hf_config.vocab_size)
        self.grammars = GrammarMasks(tokenizer, self.vocab_size, self.stopping.eos)
        self.sampler = Sampler(config.seed, self.grammars)
        self.max_model_len = self.runner.max_model_len
        self._logprobs: dict[int, int] = {}  # request id -> top logprobs wanted
        self._pending: list[RequestDelta] = []  # aborts since the last step
        self.last_error: BaseException | None = None

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: int | None = None,
        logprobs: int | None = None,
    ) -> Request:
        """Queue a request (checked first); `logprobs` = top alternatives per token (0 = just
        the sampled token's), None = no logprobs."""
        self.check_prompt(prompt_token_ids, params)
        rid = next(self._ids) if request_id is None else request_id
        req = Request(rid, list(prompt_token_ids), params, prompt)
        if params.structured is not None:
            self.grammars.add(rid, params.structured)
        if logprobs is not None:
            self._logprobs[rid] = logprobs
        self.scheduler.add(req)
        return req

    def check_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Raise ConfigError for an empty prompt, ids outside the vocabulary, a request longer
        than the context (max_model_len) or than the whole KV cache, or a grammar (structured
        output) the grammar library rejects."""
        if not prompt_token_ids:
            raise ConfigError("prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ConfigError(
                f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                f"(max_model_len), which must also hold at least one generated token"
            )
        if params is None:
            return
        if params.structured is not None:
            compile_grammar(params.structured)
        if n + params.max_tokens > self.max_model_len:
            raise ConfigError(
                f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the context of "
                f"{self.max_model_len} tokens; ask for at most {self.max_model_len - n}"
            )
        cap = self.blocks.num_blocks * self.blocks.block_size
        if n + params.max_tokens > cap:
            raise ConfigError(
                f"prompt + max_tokens = {n + params.max_tokens} tokens exceeds the KV cache "
                f"({cap} tokens); lower max_tokens or raise the KV cache size"
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or running request and free its KV blocks; False if unknown."""
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        req.finished, req.finish_reason = True, "abort"
        self._pending.append(self._delta(req))
        self._forget(req)
        return True

    def step(self) -> list[RequestDelta]:
        """Run one step; return what changed for each request (new tokens, text, finish)."""
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return self._take_pending()
        stats = self.runner.stats
        stats.begin_step(all(s.num_new_tokens == 1 and s.samples for s in batch.scheduled))
        try:
            logits = self.runner.execute(batch)
            sampled = self._sample(batch, logits)
        except Exception as exc:  # noqa: BLE001 - a failed step must not take the engine down
            return self._fail(batch.scheduled, exc)
        finally:
            self.runner.after_step()
            stats.end_step()
        return self._update(batch, *sampled)

    def _sample(
        self, batch: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[ScheduledRequest], list[int], dict[int, TokenLogprob], list[ScheduledRequest]]:
        """(rows sampled, their tokens, logprobs, rows whose logits are not finite). Logprobs
        are of the model's distribution, before any grammar mask."""
        rows = [s for s in batch.scheduled if s.samples]
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # [N]: NaN never becomes a token
        bad = [s for s, ok in zip(rows, finite) if not ok]
        if bad:
            logits = logits[[i for i, ok in enumerate(finite) if ok]]
            rows = [s for s, ok in zip(rows, finite) if ok]
        ids = [s.request.request_id for s in rows]
        tokens = self.sampler.sample(logits, ids, [s.request.params for s in rows])
        return rows, tokens, self._token_logprobs(logits, ids, tokens), bad

    def _update(
        self,
        batch: SchedulerOutput,
        rows: list[ScheduledRequest],
        tokens: list[int],
        lps: dict[int, TokenLogprob],
        bad: list[ScheduledRequest],
    ) -> list[RequestDelta]:
        for s in batch.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if all(s is not b for b in bad):  # a failing request's K/V is never shared
                self.scheduler.computed(s.request)
        out = self._fail(bad, FloatingPointError("non-finite logits")) if bad else []
        out += self._take_pending()
        broken = self.grammars.take_errors()
        for s, tok in zip(rows, tokens):
            req = s.request
            if req.request_id in broken:
                out += self._fail([s], ValueError(f"structured output: {broken[req.request_id]}"))
                continue
            req.output_token_ids.append(tok)
            done = self.stopping.check(req)
            out.append(self._delta(req, [tok], lps.get(req.request_id)))
            if done:
                self._forget(req)
        return out

    def _token_logprobs(
        self, logits: torch.Tensor, ids: list[int], tokens: list[int]
    ) -> dict[int, TokenLogprob]:
        """Log-probabilities of the sampled tokens for requests that asked (one sync then)."""
        rows = [i for i, rid in enumerate(ids) if rid in self._logprobs]
        if not rows:
            return {}
        lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [n, V]
        chosen = lp[torch.arange(len(rows)), [tokens[i] for i in rows]].tolist()
        k = max(self._logprobs[ids[i]] for i in rows)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        out = {}
        for j, i in enumerate(rows):
            n = self._logprobs[ids[i]]
            top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
            out[ids[i]] = TokenLogprob(tokens[i], float(chosen[j]), top)
        return out

    def _fail(self, scheduled: list[ScheduledRequest], exc: Exception) -> list[RequestDelta]:
        """Fail these requests with the error; their K/V past the progress counters is
        dropped with their blocks, so no other request sees it."""
        log.error("engine step failed; failing %d requests: %r", len(scheduled), exc)
        self.last_error = exc
        out = self._take_pending()
        for s in scheduled:
            req = s.request
            req.finished, req.finish_reason = True, "error"
            out.append(self._delta(req, error=f"{type(exc).__name__}: {exc}"))
            self._forget(req)
        return out

    def _delta(
        self,
        req: Request,
        tokens: list[int] | None = None,
        logprob: TokenLogprob | None = None,
        error: str | None = None,
    ) -> RequestDelta:
        return RequestDelta(
            req.request_id,
            tokens or [],
            self.stopping.take_text(req),
            req.finished,
            req.finish_reason,
            error,
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            [logprob] if logprob is not None else [],
            req.num_cached_tokens or 0,
        )

    def _forget(self, req: Request) -> None:
        self.scheduler.finish(req)
        self.runner.end_request(req.request_id)
        self.sampler.forget(req.request_id)
        self.stopping.forget(req.request_id)
        self._logprobs.pop(req.request_id, None)

    def _take_pending(self) -> list[RequestDelta]:
        out, self._pending = self._pending, []
        return out

    def stats(self) -> dict[str, float]:
        """Scheduler, KV cache and offload counters (plain numbers, for metrics)."""
        out: dict[str, float] = dict(self.runner.stats.to_dict())
        out.update(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_free=self.blocks.num_free,
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_cached=self.blocks.num_cached,
            kv_bytes_per_token=self.runner.kv_cache.bytes_per_token,
            kv_cache_bytes=self.runner.kv_cache.bytes(),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            device_slots=self.runner.tier_plan.device_slots,
        )
        split = self.runner.memory_split.stats()
        split.pop("split_reason")  # a name: the server exports it at start-up (memory_split_info)
        out.update(split)
        for row in self.runner.all_rank_stats():  # expert parallelism: "rank{r}.{counter}"
            for key in RANK_METRIC_KEYS:
                out[f"rank{row['rank']}.{key}"] = float(row[key])
        return out

    def check_integrity(self) -> None:
        """Assert the scheduler's KV blocks (tables, refcounts, free and cached lists) and the
        expert cache are consistent."""
        self.scheduler.check_integrity()
        self.runner.expert_cache.check_integrity()

    def to_output(self, req: Request) -> RequestOutput:
        completion = CompletionOutput(
            0, req.output_text, list(req.output_token_ids), req.finish_reason
        )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [completion],
            num_cached_tokens=req.num_cached_tokens or 0,
        )
