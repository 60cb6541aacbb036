"""The generation worker behind the server: one thread owns the model and steps every running answer at once.

Each step is one batched forward (serve.batch) over every active request: a request that decodes adds its last
token, one that is still reading its prompt adds the next chunk of it (at most `prefill_chunk` prompt tokens a
step, shared in arrival order: 64 on the CPU, 512 on an accelerator), so a long prompt never stalls the others'
decode for longer than a chunk. New requests join between steps, up to `parallel` at once, each in its own slot
of a preallocated KV cache; an answer that ends (or whose client went away) leaves its slot at once, and the next
request in line takes it. Each row applies its own adapter inside the forward; nothing is switched between
requests. Where the decode steps are captured CUDA graphs and every row decodes greedily, each step is launched
before the host answers the one before it (`_decode_ahead`), so the host's work per token overlaps the GPU's.
An idle engine woken by a request waits up to `gather_s` for more before its first step (`_gather`), so that
clients who send at once share that step instead of the first reading its prompt alone.

The sampling, stop rule and streamed text of each answer are `generate.Answer`, as for `tunesmith generate`, so a
greedy answer is the one `generate` gives for that prompt alone. Requests wait in a bounded first-come, first-served
queue: past `max_waiting`, `submit` refuses (the server answers 429 with Retry-After).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tunesmith.generate import Answer, GenerationResponse, stop_token_ids

WAITING_PER_SLOT = 4  # the queue holds this many requests per slot: beyond, a client is told to come back
# Prompt tokens a step reads (shared by the rows reading theirs). On the CPU a step costs its tokens, so a chunk
# is small enough that the rows decoding beside it wait little. On an accelerator a step that reads a prompt runs
# eagerly (no decode graph), and its cost is its kernel launches (26 ms for SmolLM2-135M's 30 layers on an H100)
# until far more tokens: a small chunk would make eight prompts arriving together take several such steps instead
# of one, and every decoding row waits through each.
PREFILL_CHUNK_CPU, PREFILL_CHUNK_ACCELERATOR = 64, 512
# An idle engine's wait for the rest of a burst: requests sent together arrive a fraction of a millisecond apart
# (8 streaming clients over HTTP on an H100 host: 0.3-1.5 ms; in one run the first two came 8 ms apart, which this
# misses), and a lone request waits this once, before its first step. The wait ends as soon as the free slots are
# taken, and after GATHER_MAX_S however many come.
GATHER_S, GATHER_MAX_S = 0.002, 0.02


def prefill_chunk_for(model: torch.nn.Module) -> int:
    """The prompt tokens a step reads on the device the model is on."""
    cpu = next(iter(model.parameters())).device.type == "cpu"
    return PREFILL_CHUNK_CPU if cpu else PREFILL_CHUNK_ACCELERATOR


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
    tokens: int = 0


@dataclass(frozen=True)
class Finished:
    """What became of a job (the engine keeps the last hundred: tests and logs read them)."""

    adapter: str | None
    tokens: int
    reason: str  # stop | length | cancelled | error


class QueueFull(Exception):
    """Every slot is busy and the queue is full: the request should come back later."""


@dataclass
class _Row:
    """A job in a slot: what it still has to feed the model, and its answer so far."""

    job: Job
    slot: int
    adapter: int  # the runner's index of the job's adapter (0: the base)
    pending: list[int]  # tokens not yet in the cache: the rest of the prompt, or the last token drawn
    answer: Answer
    cached: int = 0  # tokens in the slot's cache


class Engine:
    """The worker thread and its queue; `submit` may be called from any thread."""

    def __init__(self, model: torch.nn.Module, tokenizer, parallel: int = 8, max_waiting: int | None = None,
                 prefill_chunk: int | None = None, deterministic: bool = False, gather_s: float = GATHER_S):
        self.model, self.tokenizer, self.parallel = model, tokenizer, parallel
        self.gather_s = gather_s
        self.deterministic = deterministic
        self.max_waiting = WAITING_PER_SLOT * parallel if max_waiting is None else max_waiting
        self.prefill_chunk = prefill_chunk or prefill_chunk_for(model)
        self.finished: deque[Finished] = deque(maxlen=100)
        self.steps = 0  # forwards run (tests read it)
        self._waiting: deque[Job] = deque()  # FIFO: the order requests came in
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._runner = None

    def start(self) -> None:
        if self._thread is None:
            if self._runner is None:
                self._runner = make_runner(self.model, self.tokenizer, self.parallel, self.deterministic)
                if getattr(self._runner, "decode_ahead", False):  # captured graphs: a GPU, kernels loaded lazily
                    self._runner.warm(self.prefill_chunk)
            self._closing = False
            self._thread = threading.Thread(target=self._run, name="tunesmith-generate", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the worker: every job still queued or running ends as cancelled."""
        if self._thread is not None:
            with self._wake:
                self._closing = True
                self._wake.notify()
            self._thread.join()
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise QueueFull when `max_waiting` jobs are waiting already."""
        with self._wake:
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{self.parallel} requests are being answered and {len(self._waiting)} are waiting")
            self._waiting.append(job)
            self._wake.notify()

    def _run(self) -> None:
        active: list[_Row] = []
        free = list(range(self.parallel))
        while True:
            with self._wake:
                while not (self._closing or self._waiting or active):
                    self._wake.wait()
                if not active:
                    self._gather(len(free))
                if self._closing:
                    for job in [row.job for row in active] + list(self._waiting):
                        self._end(job, "cancelled", None)
                    self._waiting.clear()
                    return
            for row in [row for row in active if row.job.cancelled.is_set()]:
                self._leave(row, active, free, "cancelled", None)
            self._compact(active, free)
            with self._wake:
                joining = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
            for job in joining:  # between steps: the next in line take the free slots
                row = self._join(job, free)
                if row is not None:
                    active.append(row)
            if active and self._ahead(active, free):
                self._decode_ahead(active, free)
            elif active:
                self._step(active, free)

    def _gather(self, room: int) -> None:
        """Idle, with a request waiting: wait while more keep coming (each within `gather_s` of the last), until
        `room` wait or GATHER_MAX_S has passed, so that a burst's prompts are read in one step. Holds self._wake."""
        deadline = time.monotonic() + max(self.gather_s, GATHER_MAX_S)
        while self.gather_s > 0 and 0 < len(self._waiting) < room and not self._closing:
            waiting, left = len(self._waiting), deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(min(self.gather_s, left))
            if len(self._waiting) == waiting:  # none came: the burst is over
                return

    def _compact(self, active: list[_Row], free: list[int]) -> None:
        """Move the rows in the highest slots into the free slots below them, so that the running answers hold
        slots 0, 1, ... and a step's attention reads one block of the cache in place instead of gathering each
        row's slot. A row's cache moves once when another answer ends; a gather costs every step."""
        for row in sorted(active, key=lambda r: r.slot, reverse=True):
            if not free or free[0] > row.slot:
                return
            to = free.pop(0)
            self._runner.move(row.slot, to, row.cached)
            free.append(row.slot)
            free.sort()
            row.slot = to

    def _join(self, job: Job, free: list[int]) -> _Row | None:
        if job.cancelled.is_set():
            self._end(job, "cancelled", None)
            return None
        try:
            answer = Answer(self.tokenizer, len(job.prompt_ids), stop_token_ids(self.tokenizer, self.model),
                            job.max_tokens, job.temperature, job.top_p, job.seed, stop=job.stop)
            adapter = self._runner.adapter_index(job.adapter)
        except Exception as e:  # the request was checked before it queued: this is a bug, reported, not fatal
            traceback.print_exc(file=sys.stderr)
            self._end(job, "error", e)
            return None
        return _Row(job, free.pop(0), adapter, list(job.prompt_ids), answer)

    def _step(self, active: list[_Row], free: list[int]) -> None:
        """One forward for every active row: decoding rows add one token, rows reading their prompt share the
        step's prefill budget in arrival order (in the deterministic mode each reads its own chunk, so where its
        chunks end does not depend on the others); every row whose tokens are all in draws its next token."""
        plan, budget = [], self.prefill_chunk
        for row in active:
            if self.deterministic:
                budget = self.prefill_chunk
            take = row.pending if row.answer.generated else row.pending[:budget]
            if not row.answer.generated:
                budget -= len(take)
            if take:
                plan.append((row, take))
        plan.sort(key=lambda p: p[0].slot)  # rows in slot order: attention reads their slots as one block
        try:
            logits = self._runner.forward([(r.slot, take, r.cached, r.adapter) for r, take in plan],
                                          [len(take) == len(r.pending) for r, take in plan])
        except Exception as e:  # a bug: the rows of this step end with it, the server goes on
            traceback.print_exc(file=sys.stderr)
            for row, _ in plan:
                self._leave(row, active, free, "error", e)
            return
        self.steps += 1
        drawing = [row for row, take in plan if len(take) == len(row.pending)]
        greedy = _greedy(logits, [row.job.temperature <= 0 for row in drawing])
        for row, take in plan:
            row.cached += len(take)
            row.pending = row.pending[len(take) :]
        for at, row in enumerate(drawing):
            self._draw(row, logits[at], greedy[at], active, free)

    def _ahead(self, rows: list[_Row], free: list[int]) -> bool:
        """Whether the next decode step may be launched before the one in flight is answered: the runner steps
        captured graphs, every row decodes greedily (its next input is the argmax of its logits, which the device
        can feed itself), and no request waits for a free slot, is cancelled, or stops the engine."""
        return (getattr(self._runner, "decode_ahead", False) and not self._closing and not (free and self._waiting)
                and all(len(r.pending) == 1 and r.answer.generated and r.job.temperature <= 0
                        and not r.job.cancelled.is_set() for r in rows))

    def _decode_ahead(self, active: list[_Row], free: list[int]) -> None:
        """Greedy decode steps, each launched before the host answers the one before it: the device reads each
        row's token from the step before (serve.graphs.DecodeGraphs.launch), and the host's work per answered
        token (its text, the stop rule, the stream) overlaps the next step instead of following it. The rows'
        answers are the ones `_step` gives. It returns once every launched step is answered, when a request
        waits for a free slot or is cancelled, a row's next token is its last, or a row ends (a row that ended
        was computed one step more, for nothing)."""
        rows = sorted(active, key=lambda r: r.slot)
        ending = False
        try:
            launched = self._runner.launch([(r.slot, r.pending, r.cached, r.adapter) for r in rows])
            while launched is not None:
                going = (not ending and self._ahead(rows, free)
                         and all(len(r.answer.generated) + 1 < r.job.max_tokens for r in rows))
                after = (self._runner.launch([(r.slot, [0], r.cached + 1, r.adapter) for r in rows], launched.device)
                         if going else None)
                tokens = launched.tokens()
                self.steps += 1
                for row, token in zip(rows, tokens, strict=True):
                    if row in active and not row.job.cancelled.is_set():  # a cancelled one leaves in _run
                        row.cached += 1
                        row.pending = []
                        self._draw(row, None, token, active, free)
                ending = any(row not in active or row.job.cancelled.is_set() for row in rows)
                launched = after
        except Exception as e:  # a bug: as in _step, the rows end with it and the server goes on
            traceback.print_exc(file=sys.stderr)
            for row in [r for r in rows if r in active]:
                self._leave(row, active, free, "error", e)

    def _draw(self, row: _Row, logits: torch.Tensor | None, token: int | None, active: list[_Row],
              free: list[int]) -> None:
        try:
            r = row.answer.add(logits, token)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._leave(row, active, free, "error", e)
            return
        row.job.tokens = r.generated_tokens
        row.job.emit(r)
        if r.finish_reason:
            self._leave(row, active, free, r.finish_reason, None)
        else:
            row.pending = [r.token]

    def _leave(self, row: _Row, active: list[_Row], free: list[int], reason: str, error: BaseException | None):
        active.remove(row)
        free.append(row.slot)
        free.sort()
        self._end(row.job, reason, error)

    def _end(self, job: Job, reason: str, error: BaseException | None) -> None:
        self.finished.append(Finished(job.adapter, job.tokens, reason))
        job.emit(error)


def _greedy(logits: torch.Tensor, rows: list[bool]) -> list[int | None]:
    """The greedy rows' tokens, drawn together (one wait for the device, not one per row); None for the others."""
    picked = [i for i, g in enumerate(rows) if g]
    if not picked:
        return [None] * len(rows)
    tokens = iter(logits[picked].argmax(-1).tolist() if len(picked) < len(rows) else logits.argmax(-1).tolist())
    return [next(tokens) if g else None for g in rows]


def make_runner(model: torch.nn.Module, tokenizer, slots: int, deterministic: bool = False):
    """The batched forward for this model (serve.batch.BatchedLM), or the per-row fallback where it cannot run
    (which is deterministic already: each row runs alone)."""
    from tunesmith.models import context_length
    from tunesmith.serve.batch import BatchedLM, PerRow, unsupported

    model.eval()
    if unsupported(model) is None:
        # the stacked LoRA's mask and addition as one Triton kernel where Triton runs (BatchedLM's `fused`): 8 mixed
        # clients decoded 7% faster each on both shapes (docs/SERVE.md); the deterministic mode keeps PyTorch's ops
        return BatchedLM(model, slots, context_length(model, tokenizer), deterministic, fused=not deterministic)
    return PerRow(model, slots)
