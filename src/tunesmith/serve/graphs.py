"""The decode step as CUDA graphs: one captured forward per (batch bucket, cache-length bucket, LoRA or not).

A decode-only step (every row adds one token) is what a server runs almost all the time, and eagerly it costs a
kernel launch, and Python, per op of every layer: on a GPU that, not the weights' bytes, sets its speed. Here the
step reads its inputs from static buffers (token, position, slot and adapter of each row), so one captured graph
replays it for any rows of that shape:

- Batch buckets 1, 2, 4, 8, ... up to the slots (and the slots themselves): a step of 3 rows runs the 4-row graph,
  its fourth row a padding row that writes its key and value to a scratch slot no request uses (`BatchedLM`
  keeps one beyond the slots) and whose logits are dropped.
- Cache-length buckets (256, 512, ... up to the cache allocated): attention reads each row's slot up to the bucket,
  a mask hiding what lies past the row's own position, so a graph stays valid as the rows grow, until the longest
  passes its bucket. Growing the cache itself (rare: serve.batch) drops every graph, as their addresses die.
- Batches of the base only skip the LoRA products, as the eager forward does: a graph with LoRA and one without
  (the deterministic mode always takes the one with LoRA).

Graphs are captured when first needed (`warm` captures the short ones up front). Prefill and mixed steps stay
eager. Off CUDA, or where a capture fails (a quantized base whose kernels cannot be captured, say), the same static
step runs eagerly: the answers are the same, only the launches cost. The static step is also the deterministic
mode's (serve --deterministic): every decode step at one fixed shape, the whole batch over the whole cache.
"""

from __future__ import annotations

import sys

import torch

LENGTH_MIN = 256  # the smallest cache-length bucket


def batch_buckets(slots: int) -> list[int]:
    """Powers of two below `slots`, then `slots`: the batch sizes a graph is captured for."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return [*out, slots]


def pick(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n` rows."""
    return next(b for b in buckets if b >= n)


def length_bucket(length: int, allocated: int) -> int:
    """The cache positions a step attends over for rows reaching `length`: the next power of two (at least
    LENGTH_MIN), within the cache allocated."""
    return min(allocated, max(LENGTH_MIN, 1 << (length - 1).bit_length()))


class Launched:
    """A decode step in flight (`DecodeGraphs.launch`): each row's greedy token on the device, and on its way to
    the host."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor, done):
        self.device, self._host, self._done = device, host, done

    def tokens(self) -> list[int]:
        """The rows' tokens, once the step has run."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


class DecodeGraphs:
    """Static inputs and the graphs captured over them for one `BatchedLM`; see the module's docstring.

    capture: replay CUDA graphs (CUDA only); False runs the same static step eagerly (the CPU, tests, a fallback).
    fixed: every step at the largest bucket and over the whole allocated cache (the deterministic mode)."""

    def __init__(self, lm, capture: bool, fixed: bool = False):
        self.lm, self.capture, self.fixed = lm, capture, fixed
        self.batches = batch_buckets(lm.slots)
        self.scratch = lm.slots  # the padding rows' slot
        device = lm.keys.device
        self.inputs = torch.zeros(4, self.batches[-1], dtype=torch.long, device=device)  # ids, positions, slots, adapters
        self.rows = torch.arange(self.batches[-1], device=device)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.cache = None  # the cache tensor the graphs were captured over
        self.captures = self.replays = 0  # counted for tests and logs

    def shape(self, rows: int, length: int) -> tuple[int, int]:
        """The (batch, cache length) a step of `rows` rows reaching `length` positions runs at."""
        allocated = self.lm.keys.shape[2]
        if self.fixed:
            return self.batches[-1], allocated
        return pick(rows, self.batches), length_bucket(length, allocated)

    def run(self, rows: list[tuple[int, list[int], int, int]]) -> torch.Tensor:
        """Logits after each row's one new token, [rows, vocab]; the rows are (slot, [token], cached, adapter)."""
        logits = self._logits(rows, None)
        return logits.clone() if self.capture else logits  # the next replay overwrites a graph's output

    def _logits(self, rows: list[tuple[int, list[int], int, int]], ids: torch.Tensor | None) -> torch.Tensor:
        """The step's logits: a graph's own output where one replayed (valid until the next replay), else the
        static step's. ids: the rows' tokens as a tensor on the device (a launched step's; see `launch`)."""
        lm = self.lm
        n = len(rows)
        lm.ensure_length(max(start + 1 for _, _, start, _ in rows))
        batch, length = self.shape(n, max(start + 1 for _, _, start, _ in rows))
        # a batch of the base only skips the LoRA products; not in the fixed mode, where a base row must get the
        # same bits alone as beside adapters' rows (the joined product has more columns: serve.batch.Projection)
        lora = bool(lm.layouts) and (self.fixed or any(a for *_, a in rows))
        for slot in {s for s, *_ in rows} | {self.scratch}:
            lm.zero_ahead(slot, length)
        if not self.capture:
            self._fill(rows, batch, ids)
            return self.step(batch, length, lora)[:n]
        if self.cache is not lm.keys:  # the cache grew: every graph read the old one
            self.graphs.clear()
            self.cache = lm.keys
        key = (batch, length, lora)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(batch, length, lora)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot be captured: the same step, eagerly
                self._give_up(e)
                return self._logits(rows, ids)
        self._fill(rows, batch, ids)
        graph, logits = self.graphs[key]
        graph.replay()
        self.replays += 1
        return logits[:n]

    def warm(self, length: int = LENGTH_MIN) -> None:
        """Capture every batch bucket at the shortest cache length (with and without LoRA) before requests come."""
        if not self.capture:
            return
        length = self.shape(1, length)[1]
        self.lm.zero_ahead(self.scratch, length)
        self.cache = self.lm.keys
        for batch in self.batches[-1:] if self.fixed else self.batches:
            for lora in ((True,) if self.fixed else (False, True)) if self.lm.layouts else (False,):
                if (batch, length, lora) not in self.graphs:
                    self.graphs[(batch, length, lora)] = self._capture(batch, length, lora)

    def step(self, batch: int, length: int, lora: bool) -> torch.Tensor:
        """The forward of the first `batch` rows of the static inputs over `length` cache positions: what a graph
        captures (everything it computes is a function of the buffers)."""
        ids, positions, slots, adapters = self.inputs[:, :batch]
        step = self.lm.decode_step(ids, positions, slots, adapters, self.rows[:batch], length)
        masks = self.lm.masks(adapters) if lora else [None] * len(self.lm.layouts)
        return self.lm.run(step, masks)

    def launch(self, rows: list[tuple[int, list[int], int, int]], ids: torch.Tensor | None = None) -> Launched:
        """`run` for rows decoding greedily, without waiting for the device: each row's next token (the argmax of
        its logits, as the engine draws a greedy row's) stays on the device, where the next launch reads it as
        `ids`, and is copied to the host behind the step. So the host answers one step while the device runs the
        next (serve.engine)."""
        tokens = self._logits(rows, ids).argmax(-1)  # read before the next replay, in the stream's order
        if tokens.device.type != "cuda":
            return Launched(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(tokens, host, done)

    def _fill(self, rows: list[tuple[int, list[int], int, int]], batch: int, ids: torch.Tensor | None) -> None:
        """The rows' inputs into the static buffers, with padding rows (token 0 at position 0 of the scratch slot,
        no adapter) after them: one copy to the device, which does not wait for the steps before it (from pinned
        memory, on CUDA); `ids`, already on the device, then stand for the rows' tokens."""
        pad = batch - len(rows)
        host = torch.tensor([[0 if ids is not None else tokens[0] for _, tokens, _, _ in rows] + [0] * pad,
                             [start for _, _, start, _ in rows] + [0] * pad,
                             [slot for slot, *_ in rows] + [self.scratch] * pad,
                             [a for *_, a in rows] + [0] * pad])
        cuda = self.inputs.device.type == "cuda"
        self.inputs[:, :batch].copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
        if ids is not None:
            self.inputs[0, : len(rows)].copy_(ids)

    def _capture(self, batch: int, length: int, lora: bool):
        """A graph of `step` for this shape, its inputs all padding while it is warmed and captured (those runs
        write only to the scratch slot)."""
        self.inputs[0].zero_()
        self.inputs[1].zero_()
        self.inputs[2].fill_(self.scratch)
        self.inputs[3].zero_()
        self.lm.zero_ahead(self.scratch, length)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one run outside the capture: lazy initialisation, cuBLAS workspaces
            self.step(batch, length, lora)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.step(batch, length, lora)
        self.pool = graph.pool()
        self.captures += 1
        return graph, logits


    def _give_up(self, error: Exception) -> None:
        print(f"serve: decode runs without CUDA graphs ({type(error).__name__}: {error})", file=sys.stderr)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.capture, self.graphs, self.pool = False, {}, None


def make_graphs(lm, fixed: bool) -> DecodeGraphs | None:
    """The decode graphs for `lm`: captured on CUDA; elsewhere the static step run eagerly in the deterministic
    mode, and None (the packed eager step) otherwise. A capture that fails falls back to eager, said once."""
    cuda = lm.keys.device.type == "cuda"
    if not (cuda or fixed):
        return None
    graphs = DecodeGraphs(lm, capture=cuda, fixed=fixed)
    try:
        with torch.inference_mode():  # as every step runs: no autograd records the capture
            graphs.warm()
    except Exception as e:  # noqa: BLE001 - a kernel that cannot be captured: run eagerly, as the CPU does
        graphs._give_up(e)
        if not fixed:
            return None
    return graphs
