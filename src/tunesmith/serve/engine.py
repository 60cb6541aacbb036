"""The generation worker behind the server: one thread owns the model; requests wait in a first-come, first-served
queue and up to `parallel` of them are answered at once, a token each in turn.

Each answer is `generate.stream_tokens` (the one decode loop) with its own KV cache, so interleaving them changes no
answer: a greedy answer is the one `tunesmith generate` gives. Adapters share one copy of the base weights (PEFT's
named adapters); before each step the worker activates the adapter of the request it serves, or turns them all off
for the base. A request whose client went away is marked cancelled and dropped at its next turn, freeing its slot.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tunesmith.generate import GenerationResponse, stream_tokens


@dataclass
class Served:
    """What the server answers for: one model, and its adapters by name."""

    model: Any  # the loaded model: a PeftModel when adapters are served
    tokenizer: Any
    base_name: str  # the base's name in requests
    root: str  # the --model it was loaded from
    adapters: dict[str, str]  # name -> adapter folder (the PEFT adapter name is the same)
    context_length: int  # prompt + answer, in tokens


@dataclass
class Job:
    """One request's generation. `emit` is called on the worker thread with each GenerationResponse, then with None
    at the end, or with the exception that ended it."""

    adapter: str | None  # the PEFT adapter's name; None: the base model with every adapter off
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    emit: Callable[[GenerationResponse | BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: Iterator[GenerationResponse] | None = None
    tokens: int = 0


@dataclass(frozen=True)
class Finished:
    """What became of a job (the engine keeps the last hundred: tests and logs read them)."""

    adapter: str | None
    tokens: int
    reason: str  # stop | length | cancelled | error


class Engine:
    """The worker thread and its queue; `submit` may be called from any thread."""

    def __init__(self, model: torch.nn.Module, tokenizer, parallel: int = 8):
        self.model, self.tokenizer, self.parallel = model, tokenizer, parallel
        self.finished: deque[Finished] = deque(maxlen=100)
        self._waiting: queue.Queue[Job | None] = queue.Queue()  # FIFO: the order requests came in
        self._thread: threading.Thread | None = None
        self._current: str | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tunesmith-generate", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the worker: every job still queued or running ends as cancelled."""
        if self._thread is not None:
            self._waiting.put(None)
            self._thread.join()
            self._thread = None

    def submit(self, job: Job) -> None:
        self._waiting.put(job)

    def _run(self) -> None:
        active: list[Job] = []
        while True:
            while len(active) < self.parallel:  # take the next in line; wait for one only when nothing is running
                try:
                    job = self._waiting.get(block=not active)
                except queue.Empty:
                    break
                if job is None:
                    for j in active + self._drain():
                        self._end(j, "cancelled", None)
                    return
                if job.cancelled.is_set():
                    self._end(job, "cancelled", None)
                    continue
                job.stream = stream_tokens(self.model, self.tokenizer, job.prompt_ids, job.max_tokens, job.temperature,
                                           job.top_p, job.seed, job.stop)
                active.append(job)
            active = [job for job in active if self._step(job)]

    def _step(self, job: Job) -> bool:
        """One token of `job`; False once it is over."""
        if job.cancelled.is_set():
            job.stream.close()
            self._end(job, "cancelled", None)
            return False
        try:
            with self._use(job.adapter):
                r = next(job.stream)
        except Exception as e:  # the request was checked before it queued: this is a bug, reported, not fatal
            traceback.print_exc(file=sys.stderr)
            self._end(job, "error", e)
            return False
        job.tokens = r.generated_tokens
        job.emit(r)
        if r.finish_reason:
            self._end(job, r.finish_reason, None)
            return False
        return True

    def _end(self, job: Job, reason: str, error: BaseException | None) -> None:
        self.finished.append(Finished(job.adapter, job.tokens, reason))
        job.emit(error)

    def _drain(self) -> list[Job]:
        jobs = []
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _use(self, adapter: str | None) -> contextlib.AbstractContextManager:
        """The adapter (or the bare base) that this step runs with."""
        if not hasattr(self.model, "peft_config"):  # a plain model: the base is all there is
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        if adapter != self._current:
            self.model.set_adapter(adapter)
            self._current = adapter
        return contextlib.nullcontext()
