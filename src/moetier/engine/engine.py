"""The engine: owns scheduler, runner, sampler and tokenizer; one step = schedule, run, update.

Knows nothing of HTTP or tensors' layout inside the model.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from moetier.config import EngineConfig
from moetier.core import CompletionOutput, Request, RequestOutput, SamplingParams
from moetier.engine.batch import SchedulerOutput
from moetier.engine.model_runner import ModelRunner
from moetier.engine.sampler import Sampler
from moetier.engine.scheduler import Scheduler
from moetier.engine.stopping import StopChecker
from moetier.errors import ConfigError

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config.scheduler)
        self.sampler = Sampler(config.seed)
        self.stopping = StopChecker(tokenizer, self.runner.hf_config, self.runner.generation_config)
        self._ids = itertools.count()
        self.vocab_size = int(self.runner.hf_config.vocab_size)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> Request:
        self.check_prompt(prompt_token_ids)
        req = Request(next(self._ids), list(prompt_token_ids), params, prompt)
        self.scheduler.add(req)
        return req

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ConfigError for an empty prompt or token ids outside the vocabulary."""
        if not prompt_token_ids:
            raise ConfigError("prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one step; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        logits = self.runner.execute(batch)
        return self._update(batch, logits)

    def _update(self, batch: SchedulerOutput, logits: Any) -> list[Request]:
        sampling = [s for s in batch.scheduled if s.samples]
        tokens = self.sampler.sample(
            logits, [s.request.request_id for s in sampling], [s.request.params for s in sampling]
        )
        for s in batch.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        finished = []
        for s, tok in zip(sampling, tokens):
            req = s.request
            req.output_token_ids.append(tok)
            if self.stopping.check(req):
                self.scheduler.finish(req)
                self.runner.free(req.request_id)
                self.sampler.forget(req.request_id)
                finished.append(req)
        return finished

    def to_output(self, req: Request) -> RequestOutput:
        completion = CompletionOutput(
            0, req.output_text, list(req.output_token_ids), req.finish_reason
        )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion])
