"""One forward over many sequences at once, each at its own position, with its own KV cache slot and its own LoRA
adapter: the model the server's scheduler (serve.engine) steps.

`BatchedLM` runs a Llama-family decoder (llama, mistral and qwen2 without a sliding window) from the loaded
modules' own weights; its norms, linears, rotary embedding and activation are the model's modules, so a quantized
base or a bias works as it does in the model. The tokens of a step are packed one after another ([tokens, hidden]):
a row that prefills a chunk of its prompt and rows that decode one token each cost what their tokens cost, with no
padding, except in attention, where each row's queries meet its own slot of the cache.

The KV cache is one static tensor, [layers, slots + 1, length, kv heads, head dim] (the last slot is scratch, where
the decode graphs' padding rows write: serve.graphs); a row writes its keys and values at its own positions. It is allocated once for `FIRST_LENGTH` positions (or the context, if shorter) and doubled,
up to the context, in the rare step where a row needs more: a model with a long context does not reserve it all
for every slot up front. On the CPU `torch.empty` is backed by the OS only where written; positions are zeroed a
block at a time as rows reach them, so resident memory follows the longest answers, and nothing is allocated per
token. Rows whose slots are consecutive and in order (serve.engine keeps the running answers in the lowest slots)
read their keys and values in place; others are gathered.

Linears that read one input (q, k and v; gate and up) run as one product (`Projection`), their weights joined
(the modules' own weights become views of the joined one: nothing is copied). LoRA: every adapter's A of those
linears stacked by rank after the base rows, so the same product also gives x @ A for every adapter, and every B
beside it ([sum of ranks, outs], block-diagonal over the linears); a per-token mask keeps the columns of the
token's own adapter, times its scale, and zeroes the rest, so `base(x) + ((x @ A) * mask) @ B` is, for each row,
its own `base(x) + scale * B(A(x))`, and exactly base(x) for a row of the base. Three kernels per group of linears
whatever the batch holds (the product, the mask, the addition), and no copy of any weight per row: with a few
adapters, the summed rank stays far below the hidden size and this costs less than gathering each row's A and B.
(serve.grouped_lora computes the LoRA as two Triton kernels per linear that read only each token's own adapter,
or, with `fused`, the mask and the addition above as one kernel.)

On CUDA a step where every row decodes one token replays a CUDA graph (serve.graphs); the rest run as written here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tunesmith.serve import grouped_lora
from tunesmith.serve.graphs import make_graphs

SUPPORTED = ("llama", "mistral", "qwen2")
ZERO_BLOCK = 256  # cache positions zeroed at a time, ahead of the rows that will read them
FIRST_LENGTH = 4096  # cache positions per slot at first; doubled (up to the context) when a row needs more
# Attention in a packed eager step (a prompt's chunk, or rows of several lengths): any kernel but cuDNN's. On an
# H100, cuDNN's attention builds an execution plan the first time it meets a shape, 2.7 ms a layer (the 1B shape's
# 16 layers: 45-55 ms), and a step's shape (rows, widest row, cache length) is new most of the time a prompt joins;
# the memory-efficient kernel has no such cost (a step of eight short prompts: 18 ms the first time, 13 after,
# against 54 and 10). The decode graphs keep cuDNN's: each shape is captured once, and there it is the faster
# (8 rows: 2.8 ms a step against 4.2).
EAGER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # the linears that read one input


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `BatchedLM` cannot run this model, or None when it can."""
    inner = model.get_base_model() if hasattr(model, "peft_config") else model
    config = getattr(inner, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind} (batched: {', '.join(SUPPORTED)})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", kind == "mistral"):
        return "a sliding attention window"
    for name, module in inner.named_modules():
        if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
            return f"a DoRA adapter ({name})"
        if getattr(module, "lora_bias", {}) and any(module.lora_bias.values()):
            return f"a LoRA adapter with a bias ({name})"
    return None


class Projection:
    """The linears of one layer that read the same input (q, k and v; gate and up; o; down), and every adapter's
    LoRA over them, as few products as their weights allow.

    Plain linears (`torch.nn.Linear` over an unquantized weight) are joined: one weight, their rows one after
    another and then every adapter's A of each ([outs + sum of ranks, in]), so one product gives the base outputs
    and every LoRA's x @ A together. The modules' own weights become views of the joined one (no second copy).
    Then the masked ranks times B, block-diagonal over the linears ([sum of ranks, outs]), are added in place: three
    kernels for the group where each linear on its own took three. A base-only step multiplies by the base rows
    alone. Other bases (quantized) run as their modules, their outputs joined, then the same LoRA product over the
    input. With `fused` (where Triton runs), the mask's product and the addition are one kernel
    (serve.grouped_lora.masked_add). With `kernel`, each linear's LoRA runs serve.grouped_lora's kernels instead."""

    def __init__(self, modules: list[torch.nn.Module], adapters: list[str | None], layouts: dict,
                 kernel: bool = False, dtype: torch.dtype = torch.float32, fused: bool = False):
        self.fused = fused and not kernel
        self.modules = [getattr(m, "base_layer", m) for m in modules]
        self.sizes = [m.out_features for m in self.modules]
        self.rows = sum(self.sizes)  # the joined base outputs
        self.weight = self.bias = self.b = self.grouped = None
        self.layout = -1  # which per-token mask this group takes (groups with the same adapters share one)
        self.layouts: list[int] = []  # with `kernel`: each linear's (-1: no adapter on it)
        # in the model's dtype: PEFT loads a saved adapter as float32 even over a bf16 base (its forward casts
        # the input to the adapter's dtype each call; the batched forward casts the adapter once, here)
        per = [[n for n in adapters if n is not None and n in getattr(m, "lora_A", {})] for m in modules]
        a = [[m.lora_A[n].weight.detach().to(dtype) for n in names] for m, names in zip(modules, per, strict=True)]
        b = [[m.lora_B[n].weight.detach().to(dtype) for n in names] for m, names in zip(modules, per, strict=True)]
        plain = all(_plain_weight(m) is not None for m in self.modules)
        ranks = [w for ws in a for w in ws] if plain and not kernel else []
        if plain:
            self._join(ranks)
        if kernel:
            for names, ws in zip(per, a, strict=True):
                self.layouts.append(_places(layouts, adapters, names, ws[0].device) if names else -1)
            self.grouped = [grouped_lora.grouped(ws, bs, [m.scaling[n] for n in names]) if names else None
                            for m, names, ws, bs in zip(modules, per, a, b, strict=True)]
            return
        if not any(per):
            return
        # the mask's columns: per linear, per adapter on it, its rank (times its scale for the token's own)
        columns = torch.cat([_columns(adapters, names, ws, m) for m, names, ws in zip(modules, per, a, strict=True)
                             if names], dim=1)
        key = (tuple(columns.flatten().tolist()), columns.shape)
        self.layout = layouts.setdefault(key, (len(layouts), columns))[0]
        self.b = columns.new_zeros(columns.shape[1], self.rows)  # [sum of ranks, outs], block-diagonal
        r = o = 0
        for bs, size in zip(b, self.sizes, strict=True):
            for w in bs:
                self.b[r : r + w.shape[1], o : o + size] = w.t()
                r += w.shape[1]
            o += size
        if self.weight is None:
            self.a = torch.cat([w for ws in a for w in ws]).t().contiguous()  # [in, sum of ranks]

    def _join(self, ranks: list[torch.Tensor]) -> None:
        """One weight for the plain linears and the adapters' A; the modules' weights become views of it."""
        weights = [m.weight.detach() for m in self.modules]
        self.weight = torch.cat([*weights, *(w.to(weights[0].dtype) for w in ranks)])
        if any(m.bias is not None for m in self.modules):
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                                   for m, w in zip(self.modules, weights, strict=True)])
            self.bias = torch.cat([self.bias, self.bias.new_zeros(self.weight.shape[0] - self.rows)])
        at = 0
        for m, w in zip(self.modules, weights, strict=True):
            m.weight = torch.nn.Parameter(self.weight[at : at + w.shape[0]], requires_grad=m.weight.requires_grad)
            at += w.shape[0]

    def __call__(self, x: torch.Tensor, masks: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each linear's output with each token's own adapter, [tokens, out] each (views of one tensor).
        masks: per layout, each token's mask over the stacked ranks ([tokens, sum of ranks]) or, with `kernel`,
        each token's place among the linear's adapters ([tokens], -1: none); None where no token has an
        adapter."""
        mask = masks[self.layout] if self.layout >= 0 else None
        if self.weight is None:
            ys = [m(x) for m in self.modules]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
            if mask is not None and self.fused:
                grouped_lora.masked_add(y, x @ self.a, mask, self.b)
            elif mask is not None:
                y = torch.addmm(y, (x @ self.a).mul_(mask), self.b)
        elif mask is None:
            y = F.linear(x, self.weight[: self.rows], None if self.bias is None else self.bias[: self.rows])
        else:
            both = F.linear(x, self.weight, self.bias)
            y = both[:, : self.rows]
            if self.fused:
                grouped_lora.masked_add(y, both[:, self.rows :], mask, self.b)
            else:
                y.addmm_(both[:, self.rows :].mul_(mask), self.b)
        if self.grouped is not None:
            x = x.contiguous()
            outs = y.split(self.sizes, dim=-1)
            for out, layout, weights in zip(outs, self.layouts, self.grouped, strict=True):
                if weights is not None and masks[layout] is not None:
                    grouped_lora.add_lora(out, x, *weights, masks[layout])
            return list(outs)
        return list(y.split(self.sizes, dim=-1))


def _columns(adapters: list[str | None], names: list[str], a: list[torch.Tensor], module) -> torch.Tensor:
    """One linear's part of the mask: for each adapter (rows), its scale over its own ranks' columns."""
    columns = a[0].new_zeros(len(adapters), sum(w.shape[0] for w in a))
    at = 0
    for n, w in zip(names, a, strict=True):
        columns[adapters.index(n), at : at + w.shape[0]] = module.scaling[n]
        at += w.shape[0]
    return columns


def _places(layouts: dict, adapters: list[str | None], names: list[str], device: torch.device) -> int:
    """The index of the grouped kernels' layout for one linear: each adapter's place among its adapters."""
    table = torch.full((len(adapters),), -1, dtype=torch.long, device=device)
    for i, n in enumerate(names):
        table[adapters.index(n)] = i
    return layouts.setdefault(("places", tuple(table.tolist())), (len(layouts), table))[0]


@dataclass
class Step:
    """The tokens of one forward, packed row after row, and where each goes."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] each token's position in its sequence
    slots: torch.Tensor  # [B] each row's cache slot
    token_slots: torch.Tensor  # [N] the slot of each token's row
    token_rows: torch.Tensor  # [N] the row (0..B-1) of each token
    token_cols: torch.Tensor  # [N] the token's place among its row's tokens this step
    adapters: torch.Tensor  # [N] the index of each token's adapter (0: the base)
    mask: torch.Tensor  # [B, 1, T, L] which cached positions each row's queries see
    logits_at: torch.Tensor | None  # [R] the tokens whose next-token logits are wanted (None: every token)
    width: int  # T: the most tokens of one row
    length: int  # L: the longest row's cache length after this step
    first_slot: int | None  # s when the rows' slots are s, s + 1, ... in order (attention reads a view), else None


class BatchedLM:
    """The model as one batched forward over rows in cache slots; see the module's docstring."""

    def __init__(self, model: torch.nn.Module, slots: int, context: int, deterministic: bool = False,
                 lora_kernel: bool = False, fused: bool = False):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # mistral's and qwen2's too

        self.rope = apply_rotary_pos_emb
        inner = model.get_base_model() if hasattr(model, "peft_config") else model
        self.inner, self.config = inner, inner.config
        self.adapters: list[str | None] = [None, *getattr(model, "peft_config", {})]
        layouts: dict = {}
        # what the layers compute in: the embedding's output dtype, on its device (the table may be a quantized
        # tensor subclass, or quantformat's CPU int8 module, which has no `weight`); the adapters run in it too
        embed = inner.model.embed_tokens
        where = next(iter([*embed.parameters(), *embed.buffers()]))
        probe = embed(torch.zeros(1, dtype=torch.long, device=where.device))
        # fused: the stacked LoRA's mask and addition as one Triton kernel (Projection), where Triton runs (the
        # server asks for it unless --deterministic; `bench/bench_serve.py --unfused` serves without it)
        fused = fused and grouped_lora.available(probe)
        self.layers = [[Projection([layer.get_submodule(n) for n in group], self.adapters, layouts, lora_kernel,
                                   probe.dtype, fused)
                        for group in GROUPS]
                       for layer in inner.model.layers]
        # per layout, what a token's adapter index gathers: its mask's row (stacked), or its place (grouped)
        self.layouts = [per_adapter for _, per_adapter in sorted(layouts.values(), key=lambda v: v[0])]
        # per layout, the adapters (indices) that add anything through it: known here, so a step asks the host,
        # not the device, which LoRA products it needs
        self.layout_adapters = [{a for a, row in enumerate(per_adapter.tolist())
                                 if (row >= 0 if lora_kernel else any(row))} for per_adapter in self.layouts]
        self.lora_kernel = lora_kernel
        attn = inner.model.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.context, self.slots, self.deterministic = context, slots, deterministic
        self.head = _plain_cpu_weight(inner.lm_head)
        self.keys = self.values = torch.empty(0, dtype=probe.dtype, device=probe.device)
        self._grow(slots + 1, min(context, FIRST_LENGTH))  # one slot more: the decode graphs' padding rows write there
        self.clean = [0] * (slots + 1)  # positions [0, clean) of each slot hold finite numbers (written or zeroed)
        self.graphs = make_graphs(self, fixed=deterministic)
        # whether the engine may launch a decode step before answering the one before it (serve.engine): where
        # the steps are captured graphs, whose launch costs the host little beside the step it does not wait for
        self.decode_ahead = self.graphs is not None and self.graphs.capture

    def adapter_index(self, name: str | None) -> int:
        return self.adapters.index(name)

    @torch.inference_mode()
    def warm(self, tokens: int) -> None:
        """Run the packed eager step once at each power of two up to `tokens` tokens and at one less (over the base
        and, with adapters, the first one), in the scratch slot the decode graphs' padding rows write to. On CUDA
        the first step of a size pays once for what later ones reuse (its kernels loaded, its memory reserved).
        Prompts are seldom a power of two long, and a length off the multiples of 8 can take other kernels (the
        products'), so the odd sizes are warmed too. (What a new shape cost most, cuDNN's attention plan, the
        eager step no longer takes: EAGER_ATTENTION.)"""
        scratch = self.slots
        n = 2
        while n <= min(tokens, self.context):
            for size in (n - 1, n):
                for adapter in range(min(2, len(self.adapters))):
                    self._eager([(scratch, [0] * size, 0, adapter)], [True])
            n *= 2

    @torch.inference_mode()
    def launch(self, rows: list[tuple[int, list[int], int, int]], ids: torch.Tensor | None = None):
        """A decode step of greedy rows, launched and not waited for (serve.graphs.DecodeGraphs.launch)."""
        return self.graphs.launch(rows, ids)

    @torch.inference_mode()
    def forward(self, rows: list[tuple[int, list[int], int, int]], want: list[bool]) -> torch.Tensor:
        """rows: (slot, new tokens, tokens already cached, adapter index); want: whether a row needs the logits
        after its last new token. Returns those logits, [rows wanting them, vocab], in row order.

        A step where every row decodes runs the decode graphs (serve.graphs) where there are any; other steps run
        packed and eager. In the deterministic mode a row that reads its prompt runs alone, and the decoding rows
        run at the graphs' one fixed shape, so no row's numbers depend on what else is in the batch."""
        decoding = [len(tokens) == 1 and w for (_, tokens, _, _), w in zip(rows, want, strict=True)]
        if self.graphs is not None and all(decoding):
            return self.graphs.run(rows)
        if not self.deterministic:
            return self._eager(rows, want)
        out: list[torch.Tensor | None] = [None] * len(rows)
        decode = [i for i, d in enumerate(decoding) if d]
        if decode:
            for i, logits in zip(decode, self.graphs.run([rows[i] for i in decode]), strict=True):
                out[i] = logits
        for i in (i for i, d in enumerate(decoding) if not d):
            logits = self._eager([rows[i]], [want[i]])
            out[i] = logits[0] if want[i] else None
        kept = [o for o in out if o is not None]
        return torch.stack(kept) if kept else torch.empty(0)

    def _eager(self, rows: list[tuple[int, list[int], int, int]], want: list[bool]) -> torch.Tensor:
        """The packed forward of any rows, planned for this step."""
        step = self._plan(rows, want)
        self.ensure_length(step.length)
        for slot in (s for s, *_ in rows):
            self.zero_ahead(slot, step.length)
        present = {a for *_, a in rows}
        masks = [m if present & adapters else None  # no token of it: no LoRA
                 for m, adapters in zip(self.masks(step.adapters), self.layout_adapters, strict=True)]
        return self.run(step, masks, eager=True)

    def masks(self, adapters: torch.Tensor) -> list[torch.Tensor]:
        """What each linear's LoRA takes for tokens of these adapters (Projection.__call__), per layout."""
        return [per_adapter[adapters] for per_adapter in self.layouts]

    def run(self, step: Step, masks: list[torch.Tensor | None], eager: bool = False) -> torch.Tensor:
        """The model over a planned step: the next-token logits at `step.logits_at`, as float32. `eager`: the
        packed step, not a decode graph's (`attention_kernels`)."""
        model = self.inner.model
        x = model.embed_tokens(step.ids)
        cos, sin = model.rotary_emb(x, step.positions[None])
        cos, sin = cos[0], sin[0]
        with attention_kernels(self.keys.device.type, self.deterministic, eager):
            for i, (layer, linears) in enumerate(zip(model.layers, self.layers, strict=True)):
                x = self._layer(i, layer, linears, x, cos, sin, step, masks)
        x = model.norm(x if step.logits_at is None else x[step.logits_at])
        if self.head is not None and x.shape[0] > 1:
            # weight @ x^T rather than x @ weight^T: MKL's product over a vocabulary-long weight (113 MB for
            # SmolLM2's 49k tokens) with a few rows is 1.6x faster this way round; one row is as fast either way
            return (self.head @ x.t()).t().float()
        return self.inner.lm_head(x).float()

    def decode_step(self, ids, positions, slots, adapters, token_rows, length: int) -> Step:
        """One new token per row at its position, every row's logits wanted, attention over `length` cache
        positions: the step a decode graph captures (serve.graphs), built only from its static buffers."""
        keep = torch.arange(length, device=positions.device)[None] <= positions[:, None]
        return Step(ids=ids, positions=positions, slots=slots, token_slots=slots, token_rows=token_rows,
                    token_cols=torch.zeros_like(positions), adapters=adapters, mask=keep[:, None, None],
                    logits_at=None, width=1, length=length, first_slot=None)

    def ensure_length(self, length: int) -> None:
        """A cache of at least `length` positions per slot (doubled, up to the context, when it is shorter)."""
        if length > self.keys.shape[2]:
            self._grow(self.keys.shape[1], min(self.context, max(2 * self.keys.shape[2], length)))

    def _layer(self, i: int, layer, projections: list[Projection], x, cos, sin, step: Step, masks) -> torch.Tensor:
        qkv, o_proj, gate_up, down = projections
        n, d = x.shape[0], self.head_dim
        h = layer.input_layernorm(x)
        q, k, v = (t.view(n, -1, d) for t in qkv(h, masks))
        q, k = self.rope(q, k, cos, sin, unsqueeze_dim=1)
        self.keys[i].index_put_((step.token_slots, step.positions), k)
        self.values[i].index_put_((step.token_slots, step.positions), v)
        rows = len(step.slots)
        if step.first_slot is not None:  # the rows hold consecutive slots, in order: read them in place
            keys = self.keys[i, step.first_slot : step.first_slot + rows, : step.length].transpose(1, 2)
            values = self.values[i, step.first_slot : step.first_slot + rows, : step.length].transpose(1, 2)
        else:  # [B, kv heads, L, d]
            keys = self.keys[i, :, : step.length].index_select(0, step.slots).transpose(1, 2)
            values = self.values[i, :, : step.length].index_select(0, step.slots).transpose(1, 2)
        if step.width == 1:  # every row adds one token: the packed tokens are already one per row
            queries = q.view(rows, 1, -1, d)
        else:
            queries = q.new_zeros(rows, step.width, q.shape[1], d)
            queries[step.token_rows, step.token_cols] = q
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=step.mask,
                                             scale=self.scale, enable_gqa=True).transpose(1, 2)
        out = out.reshape(n, -1) if step.width == 1 else out[step.token_rows, step.token_cols].reshape(n, -1)
        x = x + o_proj(out, masks)[0]
        h = layer.post_attention_layernorm(x)
        gate, up = gate_up(h, masks)
        return x + down(layer.mlp.act_fn(gate) * up, masks)[0]

    def _plan(self, rows: list[tuple[int, list[int], int, int]], want: list[bool]) -> Step:
        """The step's index tensors, built once and shared by every layer."""
        device = self.keys.device
        counts = [len(tokens) for _, tokens, _, _ in rows]
        ids = [t for _, tokens, _, _ in rows for t in tokens]
        positions = [start + j for _, tokens, start, _ in rows for j in range(len(tokens))]
        token_rows = [r for r, c in enumerate(counts) for _ in range(c)]
        ends, at = [], 0
        for c in counts:
            at += c
            ends.append(at - 1)
        width, length = max(counts), max(start + len(tokens) for _, tokens, start, _ in rows)
        starts = torch.tensor([start for _, _, start, _ in rows], device=device)
        counts_t = torch.tensor(counts, device=device)
        # the query at column t of row b sits at position start_b + t (padding columns repeat the last one)
        query_pos = starts[:, None] + torch.minimum(torch.arange(width, device=device)[None], counts_t[:, None] - 1)
        mask = torch.arange(length, device=device)[None, None] <= query_pos[:, :, None]
        token_rows_t = torch.tensor(token_rows, device=device)
        order = [slot for slot, *_ in rows]
        first = order[0]
        slots = torch.tensor(order, device=device)
        positions_t = torch.tensor(positions, device=device)
        return Step(
            ids=torch.tensor(ids, device=device), positions=positions_t, slots=slots,
            token_slots=slots[token_rows_t], token_rows=token_rows_t, token_cols=positions_t - starts[token_rows_t],
            adapters=torch.tensor([a for (_, tokens, _, a) in rows for _ in tokens], device=device),
            mask=mask[:, None], logits_at=torch.tensor([e for e, w in zip(ends, want, strict=True) if w],
                                                       device=device, dtype=torch.long),
            width=width, length=length, first_slot=first if order == list(range(first, first + len(order))) else None)

    def move(self, source: int, to: int, cached: int) -> None:
        """Move a row's `cached` positions from one slot to another (serve.engine keeps rows in the lowest slots)."""
        self.keys[:, to, :cached] = self.keys[:, source, :cached]
        self.values[:, to, :cached] = self.values[:, source, :cached]
        self.clean[to] = max(self.clean[to], cached)

    def _grow(self, slots: int, length: int) -> None:
        """A cache of `length` positions per slot, holding what the current one holds."""
        shape = (len(self.layers), slots, length, self.config.num_key_value_heads, self.head_dim)
        keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
        if self.keys.numel():
            keys[:, :, : self.keys.shape[2]] = self.keys
            values[:, :, : self.values.shape[2]] = self.values
        self.keys, self.values = keys, values

    def zero_ahead(self, slot: int, length: int) -> None:
        """Attention reads every slot up to the longest row's length: what a shorter row has not written must be
        finite (a stale value is; fresh memory may not be), as a masked position's weight is 0 but 0 * NaN is
        not."""
        if self.clean[slot] >= length:
            return
        end = min(self.keys.shape[2], -(-length // ZERO_BLOCK) * ZERO_BLOCK)
        self.keys[:, slot, self.clean[slot] : end].zero_()
        self.values[:, slot, self.clean[slot] : end].zero_()
        self.clean[slot] = end


def attention_kernels(device_type: str, deterministic: bool, eager: bool):
    """The attention kernels a step may take: PyTorch's math kernel in the deterministic mode (on an H100 the fused
    kernel it picks for a decode step over the whole cache, 8 rows and 4,096 positions, gave a row other bits now
    and then for the same inputs; the math kernel, the same bits every time); EAGER_ATTENTION for a packed eager
    step on CUDA; else PyTorch's own choice. Its switches are process-wide: a second engine stepping at that
    moment in another thread would take the same kernels (one server runs one engine)."""
    if deterministic:
        return sdpa_kernel(SDPBackend.MATH)
    return sdpa_kernel(EAGER_ATTENTION) if eager and device_type == "cuda" else contextlib.nullcontext()


def _plain_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight of a plain linear (`torch.nn.Linear` itself, not quantized, not wrapped), else None."""
    if type(module) is not torch.nn.Linear:
        return None
    w = module.weight
    return w if type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor else None  # not a tensor subclass


def _plain_cpu_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight of a plain fp32 linear without bias on the CPU, else None."""
    w = _plain_weight(module)
    ok = w is not None and module.bias is None and w.dtype == torch.float32 and w.device.type == "cpu"
    return w if ok else None


class PerRow:
    """The fallback for a model `BatchedLM` does not run: each row's tokens through the model's own forward, with
    its own DynamicCache and its adapter switched in (PEFT's set_adapter; all off for the base). The scheduling is
    the same; a step costs what its rows cost one after another."""

    def __init__(self, model: torch.nn.Module, slots: int):
        self.model = model
        self.adapters: list[str | None] = [None, *getattr(model, "peft_config", {})]
        self.caches: list = [None] * slots
        self.device = next(model.parameters()).device
        self._current: str | None = None

    def adapter_index(self, name: str | None) -> int:
        return self.adapters.index(name)

    @torch.inference_mode()
    def forward(self, rows: list[tuple[int, list[int], int, int]], want: list[bool]) -> torch.Tensor:
        from transformers import DynamicCache

        out = []
        for (slot, tokens, start, adapter), wanted in zip(rows, want, strict=True):
            if start == 0:  # a new answer in this slot
                self.caches[slot] = DynamicCache()
            with self._use(self.adapters[adapter]):
                logits = self.model(input_ids=torch.tensor([tokens], device=self.device),
                                    past_key_values=self.caches[slot], use_cache=True).logits[0, -1]
            if wanted:
                out.append(logits.float())
        return torch.stack(out) if out else torch.empty(0)

    def move(self, source: int, to: int, cached: int) -> None:
        self.caches[to], self.caches[source] = self.caches[source], None

    def _use(self, adapter: str | None):
        import contextlib

        if not hasattr(self.model, "peft_config"):  # a plain model: the base is all there is
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        if adapter != self._current:
            self.model.set_adapter(adapter)
            self._current = adapter
        return contextlib.nullcontext()
