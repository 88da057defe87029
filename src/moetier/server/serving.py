"""Chat and text completions: prompt building, checks, and JSON or SSE responses.

Owns the OpenAI/vLLM response shapes and the per-request life on the server side (submit, relay
deltas, abort on disconnect); never touches tensors or engine internals.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moetier.core import SamplingParams, StructuredOutput
from moetier.engine.outputs import RequestDelta, TokenLogprob
from moetier.engine.structured import compile_grammar
from moetier.errors import ConfigError
from moetier.metrics import ServerMetrics
from moetier.server.app import APIError, ServerSettings
from moetier.server.engine_process import EngineClient, Rejected, StreamEvent, Unavailable
from moetier.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from moetier.server.tools import ChoiceStream, body_plan, final_message, message_dicts
from moetier.tools.support import ToolError, ToolPlan, ToolSupport

Body = ChatCompletionRequest | CompletionRequest


@dataclass
class _Choice:
    rid: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # with `error`: 400 rejected at admission, 503 ended by shutdown
    last_t: float | None = None
    cached_tokens: int = 0  # prompt tokens the engine reused from the KV prefix cache


@dataclass
class _Job:
    id: str
    created: int
    arrival: float
    prompts: list[list[int]]
    choices: list[_Choice]
    queue: asyncio.Queue[tuple[int, StreamEvent]]
    chat: bool
    want_logprobs: bool
    plan: ToolPlan = field(default_factory=ToolPlan)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict[str, Any]:
        """OpenAI usage; prompt tokens count each prompt once (not once per `n` choice), so
        cached_tokens is each prompt's first choice's reused prefix."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        first = {c.prompt_index: c for c in reversed(self.choices)}
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(c.cached_tokens for c in first.values())
            },
        }


class _AbortingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, disconnect, error)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Serving:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        settings: ServerSettings,
        metrics: ServerMetrics,
    ) -> None:
        self.client, self.tokenizer, self.settings, self.metrics = (
            client,
            tokenizer,
            settings,
            metrics,
        )
        self.tools = ToolSupport(tokenizer, settings.tool_call_parser)

    # ---- entry points

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_body(body)
        try:
            plan, tools = (
                body_plan(self.tools, body) if self._has_template() else (ToolPlan(), None)
            )
        except ToolError as exc:
            raise APIError(400, str(exc), param=exc.param, code="unsupported") from exc
        structured, field_name = self._constraint(body)
        if plan.forced is not None:
            if structured is not None:
                raise APIError(
                    400,
                    f"{field_name} cannot be combined with a forced tool call (tool_choice "
                    "required or a named function)",
                    param=field_name,
                )
            structured = self._checked(plan.forced, "tool_choice")
        prompt = self._chat_prompt(body, tools)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = self._start([prompt], body, max_tokens, top, True, structured, plan)
        return await self._respond(job, body, request)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_body(body)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        prompts = self._completion_prompts(body.prompt)
        job = self._start(
            prompts, body, body.max_tokens, body.logprobs, chat=False,
            structured=self._constraint(body)[0],
        )  # fmt: skip
        return await self._respond(job, body, request)

    # ---- checks and prompts

    def _check_body(self, body: Body) -> None:
        self._check_model(body.model)
        field_name = body.unsupported()
        if field_name is not None:
            raise APIError(
                400,
                f"{field_name} is not supported by this server; leave it out",
                param=field_name,
                code="unsupported_field",
            )

    def _constraint(self, body: Body) -> tuple[StructuredOutput | None, str | None]:
        """(the output constraint, the field that asked for it): response_format (JSON),
        guided_choice or guided_regex, at most one of them; checked by the grammar library
        (400 naming the field if refused)."""
        asked: list[tuple[str, StructuredOutput]] = []
        fmt = self._structured(body)
        if fmt is not None:
            asked.append(("response_format", fmt))
        if body.guided_choice is not None:
            asked.append(("guided_choice", StructuredOutput(choice=list(body.guided_choice))))
        if body.guided_regex is not None:
            asked.append(("guided_regex", StructuredOutput(regex=body.guided_regex)))
        if len(asked) > 1:
            names = " and ".join(name for name, _ in asked)
            raise APIError(
                400,
                f"{names} cannot be combined: give at most one of response_format (JSON), "
                "guided_choice and guided_regex",
                param=asked[1][0],
            )
        if not asked:
            return None, None
        name, spec = asked[0]
        if name != "response_format":
            code = "invalid_regex" if name == "guided_regex" else "invalid_choice"
            spec = self._checked(spec, name, code)
        return spec, name

    def _structured(self, body: Body) -> StructuredOutput | None:
        """The response_format's constraint, checked by the grammar library (400 if refused)."""
        fmt = body.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(
                    400, "response_format json_schema needs a json_schema object",
                    param="response_format.json_schema",
                )  # fmt: skip
            schema = fmt.json_schema.schema_
            spec = StructuredOutput(json=schema) if schema else StructuredOutput(json_object=True)
        else:
            spec = StructuredOutput(json_object=True)
        return self._checked(spec, "response_format")

    def _checked(
        self, spec: StructuredOutput, param: str, code: str = "invalid_schema"
    ) -> StructuredOutput:
        try:
            compile_grammar(spec)
        except ConfigError as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code=code) from exc
        return spec

    def _has_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def _check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise APIError(
                400,
                f"model {model!r} is not served here; use {self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _chat_prompt(
        self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        if not self._has_template():
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        try:
            return self.tools.render(message_dicts(body), tools)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise APIError(400, f"chat template failed: {exc}", param="messages") from exc

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
                p = list(self.tokenizer.encode(p))
            out.append([int(t) for t in p])
        return out

    def _params(
        self,
        body: Body,
        prompt: list[int],
        max_tokens: int | None,
        i: int,
        structured: StructuredOutput | None = None,
        skip_special_tokens: bool = True,
    ) -> Any:
        info = self.client.info
        limit = int(info["max_model_len"])
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        if not prompt:
            raise APIError(400, "prompt is empty after tokenization", param=param)
        if len(prompt) >= limit:
            raise APIError(
                400,
                f"prompt has {len(prompt)} tokens; the context is {limit} tokens",
                param=param,
                code="context_length_exceeded",
            )
        vocab = int(info["vocab_size"])
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must lie in [0, {vocab})", param=param)
        if max_tokens is None:
            max_tokens = min(limit, int(info["kv_tokens"])) - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} plus a {len(prompt)}-token prompt exceeds the context "
                f"of {limit} tokens; ask for at most {limit - len(prompt)}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        seed = body.seed + i if body.seed is not None else None
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=seed,
                stop=body.stop_list(),
                ignore_eos=body.ignore_eos,
                structured=structured,
                skip_special_tokens=body.skip_special_tokens and skip_special_tokens,
            )
        except ConfigError as exc:
            raise APIError(400, str(exc)) from exc

    def _start(
        self,
        prompts: list[list[int]],
        body: Body,
        max_tokens: int | None,
        logprobs: int | None,
        chat: bool,
        structured: StructuredOutput | None = None,
        plan: ToolPlan | None = None,
    ) -> _Job:
        count = len(prompts) * body.n
        keep = plan is not None and plan.parser is not None and plan.parser.keeps_special_tokens
        params = [
            self._params(body, p, max_tokens, i, structured, not keep)
            for p in prompts
            for i in range(body.n)
        ]
        cap = self.settings.max_num_seqs + self.settings.max_waiting
        if self.client.in_flight + count > cap:
            raise APIError(
                429,
                f"server busy: {self.client.in_flight} requests in flight (limit {cap}); "
                f"retry later",
                "rate_limit_error",
                code="rate_limit_exceeded",
            )
        if self.client.dead:
            raise APIError(503, self.client.dead, "server_error")
        prefix = "chatcmpl" if chat else "cmpl"
        queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
        job = _Job(
            f"{prefix}-{uuid.uuid4().hex}",
            int(time.time()),
            time.monotonic(),
            prompts,
            [],
            queue,
            chat,
            logprobs is not None,
            plan or ToolPlan(),
        )
        for index in range(count):
            rid = self.client.new_id()
            job.choices.append(_Choice(rid, index // body.n))
            prompt = prompts[index // body.n]
            self.client.submit(rid, prompt, params[index], queue, index, logprobs)
        return job

    def _abort(self, job: _Job) -> None:
        for c in job.choices:
            if c.finish_reason is None:
                self.client.abort(c.rid)

    # ---- relaying engine output

    async def _events(self, job: _Job) -> AsyncIterator[tuple[int, StreamEvent]]:
        while not job.done:
            index, ev = await job.queue.get()
            self._record(job, job.choices[index], ev)
            yield index, ev

    def _record(self, job: _Job, c: _Choice, ev: StreamEvent) -> None:
        now = time.monotonic()
        if isinstance(ev, Rejected):
            c.finish_reason, c.error, c.status = "error", ev.message, 400
            self.metrics.observe_rejected(400)
            return
        if isinstance(ev, Unavailable):
            c.finish_reason, c.error, c.status = "error", ev.message, 503
            return
        if ev.token_ids:
            since = now - (c.last_t if c.last_t is not None else job.arrival)
            for _ in ev.token_ids:
                self.metrics.observe_token(c.last_t is None, since / len(ev.token_ids))
                c.last_t = now
        c.text.append(ev.text)
        c.cached_tokens = max(c.cached_tokens, ev.num_cached_tokens)
        c.token_ids += ev.token_ids
        c.logprobs += ev.logprobs
        if ev.finished:
            c.finish_reason, c.error = ev.finish_reason or "stop", ev.error
            if ev.finish_reason in ("stop", "length"):
                n_prompt = len(job.prompts[c.prompt_index])
                self.metrics.observe_finish(
                    c.finish_reason, now - job.arrival, n_prompt, len(c.token_ids)
                )

    async def _respond(self, job: _Job, body: Body, request: Request) -> Response:
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _AbortingStream(self._stream(job, body, usage), lambda: self._abort(job))
        drain = asyncio.ensure_future(self._drain(job))
        try:
            while not drain.done():
                await asyncio.wait({drain}, timeout=0.25)
                if not drain.done() and await request.is_disconnected():
                    drain.cancel()
                    return Response(status_code=499)
        finally:
            self._abort(job)
        return self._final(job, body)

    async def _drain(self, job: _Job) -> None:
        async for _ in self._events(job):
            pass

    def _final(self, job: _Job, body: Body) -> Response:
        failed = [c for c in job.choices if c.error]
        if failed:
            c = failed[0]
            kind = "invalid_request_error" if c.status < 500 else "server_error"
            return APIError(c.status, c.error or "engine error", kind).response()
        choices = []
        for i, c in enumerate(job.choices):
            choice: dict[str, Any] = {"index": i}
            text = "".join(c.text)
            finish_reason = c.finish_reason
            if job.chat:
                choice["message"], finish_reason = final_message(job.plan, text, finish_reason)
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(job, c.logprobs) if job.want_logprobs else None
            choice["finish_reason"] = finish_reason
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = job.prompts[c.prompt_index]
            choices.append(choice)
        obj = "chat.completion" if job.chat else "text_completion"
        payload = {
            "id": job.id,
            "object": obj,
            "created": job.created,
            "model": self.settings.served_model_name,
            "choices": choices,
            "usage": job.usage(),
        }
        return JSONResponse(payload)

    def _chunk(self, job: _Job, choices: list[dict[str, Any]], usage: Any) -> str:
        payload: dict[str, Any] = {
            "id": job.id,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created,
            "model": self.settings.served_model_name,
            "choices": choices,
        }
        if usage is not False:  # False: no usage field; None: null (include_usage requested)
            payload["usage"] = usage
        return _sse(payload)

    async def _stream(self, job: _Job, body: Body, include_usage: bool) -> AsyncIterator[str]:
        usage = None if include_usage else False
        if job.chat:
            role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None}
            for i in range(len(job.choices)):
                yield self._chunk(job, [{"index": i, **role, "finish_reason": None}], usage)
        pending: dict[int, tuple[list[int], list[TokenLogprob]]] = {}
        deltas = [ChoiceStream(job.plan) for _ in job.choices]
        async for index, ev in self._events(job):
            c = job.choices[index]
            if c.error:
                kind = "invalid_request_error" if c.status < 500 else "server_error"
                yield _sse(error_body(c.error, kind, None, str(c.status)))
                self._abort(job)
                yield "data: [DONE]\n\n"
                return
            assert isinstance(ev, RequestDelta)
            # Tokens whose text is held back (a partial stop string or UTF-8 sequence, or text
            # that may open a tool call) ride along with the next chunk that carries text,
            # unless the client asked for token ids: then each step's ids go out at once.
            ids, lps = pending.setdefault(index, ([], []))
            ids += ev.token_ids
            lps += ev.logprobs
            delta = deltas[index].delta(ev.text, ev.finished) if job.chat else {}
            shows = bool(delta) if job.chat else bool(ev.text)
            if not shows and not ev.finished and not (body.return_token_ids and ids):
                continue
            part: dict[str, Any] = {"index": index}
            part.update({"delta": delta or {"content": ""}} if job.chat else {"text": ev.text})
            part["logprobs"] = self._logprobs(job, lps) if job.want_logprobs else None
            reason = deltas[index].finish_reason(c.finish_reason) if job.chat else c.finish_reason
            part["finish_reason"] = reason if ev.finished else None
            if body.return_token_ids:
                part["token_ids"] = list(ids)
            ids.clear()
            lps.clear()
            yield self._chunk(job, [part], usage)
        if include_usage:
            yield self._chunk(job, [], job.usage())
        yield "data: [DONE]\n\n"

    def _logprobs(self, job: _Job, lps: list[TokenLogprob]) -> dict[str, Any]:
        def text(t: int) -> str:
            return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

        if job.chat:
            content = [
                {
                    "token": text(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": list(text(lp.token_id).encode()),
                    "top_logprobs": [
                        {"token": text(t), "logprob": v, "bytes": list(text(t).encode())}
                        for t, v in lp.top
                    ],
                }
                for lp in lps
            ]
            return {"content": content}
        return {
            "tokens": [text(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": [],
        }
