"""The engine in its own process, and the server-side client that talks to it through queues.

Owns the child process, its command and output queues, and the routing of per-request deltas to
asyncio queues. The HTTP event loop never waits on compute: it puts commands on a queue and
awaits asyncio queues filled by a reader thread. Never touches tensors on the server side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from moetier.config import OffloadConfig
from moetier.core import SamplingParams
from moetier.engine.outputs import RequestDelta
from moetier.errors import ConfigError, MoetierError

log = logging.getLogger(__name__)

_STATS_PERIOD_S = 0.5  # offload counters resolve CUDA events: not every step


@dataclass(frozen=True)
class EngineArgs:
    """Picklable arguments of the engine process's `LLM(...)`."""

    model: str | None = None
    expert_budget: str | None = None
    host_budget: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    policy: str = "lru"
    prefetch: str | None = None
    prefetch_ahead: int = 1
    device_cache: bool = False
    stream_eviction: bool = OffloadConfig.stream_eviction
    stream_copy_now: bool = OffloadConfig.stream_copy_now
    seed: int = 0
    max_num_seqs: int | None = None  # None: the default, and the memory split may hold fewer
    max_num_batched_tokens: int = 4096
    num_kv_blocks: int | None = None
    kv_block_size: int = 16
    max_model_len: int | None = None
    threads: int | None = None  # torch CPU threads; None = auto (threads.py)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory: str | None = None
    routing_trace: str | None = None
    expert_parallel_size: int = 1
    expert_placement: str = "round-robin"
    placement_trace: str | None = None
    tokenizer: str | None = None  # a Hugging Face tokenizer instead of the model's own


@dataclass
class Submit:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None


@dataclass
class Abort:
    request_id: int


@dataclass
class Check:
    token: int


@dataclass
class Rejected:
    """The engine refused a request at admission (a user error: the server answers 400)."""

    request_id: int
    message: str


@dataclass
class Unavailable:
    """The server ended the request before the engine finished it (shutdown grace period over):
    the server answers 503."""

    request_id: int
    message: str


@dataclass
class Shutdown:
    pass


def build_llm(args: EngineArgs) -> Any:
    """The engine process's LLM (under torchrun, on a rank other than 0, it follows rank 0
    and ends the process instead of returning)."""
    from moetier.llm import LLM

    return LLM(
        args.model,
        tokenizer=args.tokenizer,
        expert_budget=args.expert_budget,
        host_budget=args.host_budget,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        policy=args.policy,
        prefetch=args.prefetch,
        prefetch_ahead=args.prefetch_ahead,
        device_cache=args.device_cache,
        stream_eviction=args.stream_eviction,
        stream_copy_now=args.stream_copy_now,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        progress=False,
        num_kv_blocks=args.num_kv_blocks,
        kv_block_size=args.kv_block_size,
        max_model_len=args.max_model_len,
        threads=args.threads,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory=args.gpu_memory,
        routing_trace=args.routing_trace,
        expert_parallel_size=args.expert_parallel_size,
        expert_placement=args.expert_placement,
        placement_trace=args.placement_trace,
    )


def engine_main(args: EngineArgs, cmd_q: Any, out_q: Any, log_level: int) -> None:
    """Entry point of the engine process: load, say ready (or fatal), then serve commands."""
    logging.basicConfig(level=log_level, format="%(levelname)s engine %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the server stops the engine with Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = build_llm(args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which exits
        out_q.put(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    eng = llm.engine
    info = {
        "model": llm.config.model,
        "max_model_len": eng.max_model_len,
        "vocab_size": eng.vocab_size,
        "kv_tokens": eng.blocks.num_blocks * eng.blocks.block_size,
        "kv_cache_dtype": eng.runner.kv_cache.format.name,
        "expert_format": eng.runner.expert_cache.packing.name,
        "expert_bytes": eng.runner.tier_plan.expert_bytes,
        "split_reason": eng.runner.memory_split.reason,
        "max_num_seqs": llm.config.scheduler.max_num_seqs,
        "expert_parallel_size": llm.config.parallel.expert_parallel_size,
    }
    out_q.put(("ready", info))
    _serve(eng, cmd_q, out_q, llm.parallel_failure)


def _serve(eng: Any, cmd_q: Any, out_q: Any, broken: Any = lambda: None) -> None:
    """The command and step loop. `broken()`: why the engine can no longer run steps (an
    expert-parallel rank failed), checked after each step: the server is told (it answers
    503 to every request from then on) and the loop ends."""
    last_stats = 0.0
    parent = os.getppid()
    while True:
        if os.getppid() != parent:
            log.error("server process is gone; engine exits")
            return
        cmds: list[Any] = []
        # Idle: block (with a timeout so counters still go out); busy: take what is there.
        with contextlib.suppress(queue.Empty):
            cmds.append(cmd_q.get(timeout=_STATS_PERIOD_S) if not eng.has_unfinished() else None)
        while True:
            try:
                cmds.append(cmd_q.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if isinstance(cmd, Shutdown):
                return
            if cmd is not None:
                _handle(eng, cmd, out_q)
        if eng.has_unfinished():
            try:
                deltas = eng.step()
            except Exception:  # a bug outside the step's own guard: stop, the server reports it
                log.exception("engine loop failed")
                return
            why = broken()
            if why is not None:
                out_q.put(("broken", why))  # the step's requests end with it (503)
                return
            if deltas:
                out_q.put(("deltas", deltas))
                failed = [d.error for d in deltas if d.error]
                if failed:  # a failed step (disk read, non-finite logits, ...): /health says so
                    out_q.put(("fault", len(failed), failed[0]))
        if time.monotonic() - last_stats > _STATS_PERIOD_S:
            out_q.put(("stats", eng.stats()))
            last_stats = time.monotonic()


def _handle(eng: Any, cmd: Any, out_q: Any) -> None:
    if isinstance(cmd, Submit):
        try:
            eng.add_request(
                cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id, logprobs=cmd.logprobs
            )
        except MoetierError as exc:
            out_q.put(("rejected", Rejected(cmd.request_id, str(exc))))
    elif isinstance(cmd, Abort):
        eng.abort(cmd.request_id)
    elif isinstance(cmd, Check):
        try:
            eng.check_integrity()
            error = None
        except AssertionError as exc:
            error = f"integrity check failed: {exc}"
        out_q.put(("check", cmd.token, error, eng.stats()))


StreamEvent = RequestDelta | Rejected | Unavailable


@dataclass
class _Stream:
    queue: asyncio.Queue[tuple[int, StreamEvent]]
    index: int


@dataclass
class EngineClient:
    """Server-side handle of the engine process; every method is safe on the event loop."""

    args: EngineArgs
    log_level: int = logging.WARNING
    info: dict[str, Any] = field(default_factory=dict)
    on_stats: Any = None  # callable(dict) for metrics

    def __post_init__(self) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads or CUDA
        self.cmd_q: Any = ctx.Queue()
        self.out_q: Any = ctx.Queue()
        self.proc = ctx.Process(
            target=engine_main,
            args=(self.args, self.cmd_q, self.out_q, self.log_level),
            name="moetier-engine",
            daemon=True,
        )
        self.streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._checks: dict[int, asyncio.Future[tuple[str | None, dict[str, float]]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None
        self.failed_requests = 0  # requests failed by an engine step error (not user errors)
        self.last_fault: tuple[float, str] | None = None  # (time.monotonic(), error)

    def start(self, timeout_s: float = 3600.0) -> dict[str, Any]:
        """Start the process and wait until the model is loaded; raise its error if it fails."""
        self.proc.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                kind, payload = self.out_q.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise MoetierError(
                        f"engine process exited with code {self.proc.exitcode} while loading"
                    ) from None
                continue
            if kind == "fatal":
                self.proc.join(timeout=10)
                raise ConfigError(f"engine failed to start: {payload}")
            if kind == "ready":
                self.info = payload
                return payload
        raise MoetierError(f"engine did not load within {timeout_s:.0f} s")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start routing engine output onto `loop` (call from the running loop)."""
        self._loop = loop
        threading.Thread(target=self._read, name="moetier-engine-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.out_q.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    self._post(self._died)
                    return
                continue
            except (EOFError, OSError):
                self._post(self._died)
                return
            if not self._post(self._dispatch, msg):
                return

    def _post(self, fn: Any, *args: Any) -> bool:
        """Run `fn(*args)` on the event loop; False once the loop is closed (the server has
        shut down: the engine's last messages and its exit have no one left to tell)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _died(self) -> None:
        self.dead = f"engine process exited (code {self.proc.exitcode})"
        log.error(self.dead)
        for rid, stream in list(self.streams.items()):
            delta = RequestDelta(rid, [], "", True, "error", self.dead)
            stream.queue.put_nowait((stream.index, delta))
        self.streams.clear()
        for fut in self._checks.values():
            if not fut.done():
                fut.set_result((self.dead, {}))

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "deltas":
            for d in msg[1]:
                stream = self.streams.get(d.request_id)
                if stream is not None:
                    stream.queue.put_nowait((stream.index, d))
                    if d.finished:
                        del self.streams[d.request_id]
        elif kind == "rejected":
            stream = self.streams.pop(msg[1].request_id, None)
            if stream is not None:
                stream.queue.put_nowait((stream.index, msg[1]))
        elif kind == "broken":  # the engine cannot run steps (an expert-parallel rank failed)
            self.dead = msg[1]
            log.error("engine stopped: %s", self.dead)
            self.end_all(self.dead)
        elif kind == "fault":
            self.failed_requests += msg[1]
            self.last_fault = (time.monotonic(), msg[2])
        elif kind == "stats" and self.on_stats is not None:
            self.on_stats(msg[1])
        elif kind == "check":
            fut = self._checks.pop(msg[1], None)
            if self.on_stats is not None:
                self.on_stats(msg[3])
            if fut is not None and not fut.done():
                fut.set_result((msg[2], msg[3]))

    def new_id(self) -> int:
        return next(self._ids)

    def submit(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        out: asyncio.Queue[tuple[int, StreamEvent]],
        index: int,
        logprobs: int | None = None,
    ) -> None:
        self.streams[request_id] = _Stream(out, index)
        self.cmd_q.put(Submit(request_id, prompt_token_ids, params, logprobs))

    def abort(self, request_id: int) -> None:
        """Abort if still unfinished (the engine frees its KV blocks); a no-op otherwise."""
        if self.streams.pop(request_id, None) is not None:
            self.cmd_q.put(Abort(request_id))

    def end_all(self, message: str) -> int:
        """End every in-flight request now with `message` (the server answers 503) and abort it
        in the engine; the number ended. For the end of the shutdown grace period."""
        streams = list(self.streams.items())
        self.streams.clear()
        for rid, stream in streams:
            stream.queue.put_nowait((stream.index, Unavailable(rid, message)))
            self.cmd_q.put(Abort(rid))
        return len(streams)

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    async def check(self, timeout_s: float = 10.0) -> tuple[str | None, dict[str, float]]:
        """(integrity error or None, fresh engine counters), answered between engine steps."""
        if self.dead:
            return self.dead, {}
        token = self.new_id()
        fut: asyncio.Future[tuple[str | None, dict[str, float]]]
        fut = asyncio.get_running_loop().create_future()
        self._checks[token] = fut
        self.cmd_q.put(Check(token))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._checks.pop(token, None)
            return f"engine did not answer within {timeout_s:.0f} s", {}

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.proc.is_alive():
            self.cmd_q.put(Shutdown())
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout_s)
