"""Checkpointed decoder layers: each keeps only its input for the backward pass, in pinned host memory with
--gradient-checkpointing offload, and is recomputed, without what its backward does not read, just before its
backward runs.

Each layer runs its forward without gradients (nothing kept but its input) inside one autograd function. With
offload on CUDA the input is copied to a pinned host buffer (one per layer, reused every step) on a side stream,
while the layer computes; in the backward pass the input of the layer below is copied back on that stream while
this layer recomputes and runs its backward, so neither copy waits on the other's compute. The recomputation
builds the layer's graph and runs its backward; the LoRA-aware MLP skips its down projection there
(`lora_mlp.output_unused`: backward reads none of the layer's output), a quarter of a Llama layer's products. A
compiled layer stays compiled: the path compiles the layer's forward in place of the module call, so the
checkpoint and its copies run outside the compiled code.

Elsewhere than CUDA there are no pinned memory or streams to overlap with: offload keeps the input where it is,
as checkpointing on does. One process (DDP and FSDP2 keep transformers' checkpointing); the same losses and
gradients as without checkpointing (the same functions recomputed, the dropout masks replayed).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from tunesmith.kernels.base import Setting, causal_lm, replace_forward, restore_forward
from tunesmith.kernels.lora_mlp import output_unused

CACHE_ARGS = ("past_key_values", "past_key_value", "cache", "layer_past")  # a recomputation must not extend a cache


@dataclass
class _Slot:
    """One layer's input while it waits for the backward pass: a host copy (offload) and, once fetched back, its
    device copy."""

    host: torch.Tensor | None = None  # pinned on CUDA; grown, never shrunk
    view: torch.Tensor | None = None  # the input's shape over `host`
    owner: weakref.ref | None = None  # the forward whose input waits here for its backward (its graph's token)
    back: torch.Tensor | None = None  # the input on the device again (prefetched or fetched)
    ready: object = None  # CUDA: the side stream's event after the copy back

    @property
    def pending(self) -> bool:
        """An input waits here: its forward's graph is alive (a graph dropped without a backward, after an error,
        frees the slot)."""
        return self.owner is not None and self.owner() is not None


class Token:
    """Stands for one layer call's graph: held by its autograd context, gone with it."""


class Offloader:
    """Layer inputs kept off the device between their forward and backward passes.

    `stash` copies an input out (CUDA: into pinned memory on a side stream, overlapping the layer's compute),
    `prefetch` starts the copy back ahead of need, `fetch` waits for it. On another device, `offload` keeps host
    copies without streams (what the CPU tests exercise); the trainer does not offload there."""

    def __init__(self, device: torch.device, offload: bool = True):
        self.device = device
        self.offload = offload
        self.stream = torch.cuda.Stream(device) if offload and device.type == "cuda" else None
        self.slots: dict[int, _Slot] = {}

    def stash(self, index: int, x: torch.Tensor, token: Token) -> bool:
        """Copy layer `index`'s input out for the call `token` stands for; False where it stays on the device (not
        offloading, or the layer's last input still waits for its backward: a second forward before the first's
        backward)."""
        if not self.offload:
            return False
        slot = self.slots.setdefault(index, _Slot())
        if slot.pending:
            return False
        slot.back = None
        n = x.numel()
        if slot.host is None or slot.host.numel() < n or slot.host.dtype != x.dtype:
            slot.host = torch.empty(n, dtype=x.dtype, pin_memory=self.stream is not None)
        slot.view = slot.host[:n].view(x.shape)
        if self.stream is None:
            slot.view.copy_(x)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # x is written
            with torch.cuda.stream(self.stream):
                slot.view.copy_(x, non_blocking=True)
            x.record_stream(self.stream)  # its memory is not reused before the copy has read it
        slot.owner = weakref.ref(token)
        return True

    def prefetch(self, index: int) -> None:
        """Start copying layer `index`'s input back, if it waits and is not on its way yet."""
        slot = self.slots.get(index)
        if slot is None or not slot.pending or slot.back is not None:
            return
        if self.stream is None:
            slot.back = slot.view.clone()
            return
        with torch.cuda.stream(self.stream):  # after the copy out, on the same stream
            slot.back = torch.empty(slot.view.shape, dtype=slot.view.dtype, device=self.device)
            slot.back.copy_(slot.view, non_blocking=True)
            slot.ready = self.stream.record_event()

    def fetch(self, index: int, token: Token) -> torch.Tensor:
        """Layer `index`'s input on the device, for the backward pass of the call `token` stands for."""
        slot = self.slots[index]
        if slot.owner is None or slot.owner() is not token:
            raise RuntimeError(f"checkpointed layer {index}: its offloaded input was overwritten before its backward")
        self.prefetch(index)
        x, slot.back, slot.owner = slot.back, None, None
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(slot.ready)
            x.record_stream(current)  # allocated on the side stream, read and freed on this one
        return x


@dataclass
class Checkpointed:
    """What the path gave one decoder layer: its place, its forward (compiled where the layer was), and what it
    replaced, to undo."""

    index: int
    run: object  # the layer's own forward, or its compiled version
    offloader: Offloader
    rng: bool  # dropout is on somewhere: the recomputation replays the forward's random numbers
    anchor: torch.Tensor  # a scalar that requires grad (see _CheckpointedLayer)
    compiled_call: object = None  # the module's compiled call the path took over
    hf_checkpointing: bool = False  # transformers' own checkpointing flag, switched off while the path holds


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed(state: tuple | None, device: torch.device):
    """The random numbers of the forward pass again inside the block (dropout's masks), the current ones after."""
    if state is None:
        yield
        return
    now = _rng_state(device)
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            torch.cuda.set_rng_state(now[1], device)


def _autocast(device_type: str) -> tuple:
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in {device_type, "cpu"})


@contextlib.contextmanager
def _autocast_as(saved: tuple):
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in saved:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


class _CheckpointedLayer(torch.autograd.Function):
    """y = layer(x), keeping only x (offloaded or not); backward recomputes the layer and runs its backward. The
    anchor, a scalar that requires grad, makes y require grad where x does not (the first layer's input, the
    frozen embedding's output), so the layer's LoRA weights still get their gradients without one for x."""

    @staticmethod
    def forward(ctx, x, anchor, state: Checkpointed, args: tuple, kwargs: dict):
        ctx.state, ctx.args, ctx.kwargs = state, args, kwargs
        ctx.rng = _rng_state(x.device) if state.rng else None
        ctx.autocast = _autocast(x.device.type)
        ctx.token = Token()
        ctx.offloaded = state.offloader.stash(state.index, x, ctx.token)
        if not ctx.offloaded:
            ctx.save_for_backward(x)
        out = state.run(x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        x = state.offloader.fetch(state.index, ctx.token) if ctx.offloaded else ctx.saved_tensors[0]
        state.offloader.prefetch(state.index - 1)  # the next backward's input, copied while this layer works
        x = x.detach().requires_grad_(ctx.needs_input_grad[0])
        with torch.enable_grad(), _replayed(ctx.rng, x.device), _autocast_as(ctx.autocast), output_unused():
            out = state.run(x, *ctx.args, **ctx.kwargs)
        y = out[0] if isinstance(out, tuple) else out
        if y.requires_grad:
            torch.autograd.backward(y, grad)
        return (x.grad if ctx.needs_input_grad[0] else None), None, None, None, None


def _checkpointed_forward(self, *args, **kwargs):
    """A decoder layer's forward under the path: checkpointed while training with gradients, else its own."""
    state: Checkpointed = vars(self)["tunesmith_checkpointed"]
    if not (self.training and torch.is_grad_enabled()):
        return state.run(*args, **kwargs)
    if args:
        x, args = args[0], args[1:]
    else:
        x = kwargs.pop("hidden_states")
    for name in CACHE_ARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return _CheckpointedLayer.apply(x, state.anchor, state, args, kwargs)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        return list(causal_lm(model).get_decoder().layers)
    except (AttributeError, TypeError):
        return []


def checkpoint_layers(model: torch.nn.Module, offloader: Offloader) -> int:
    """Checkpoint each decoder layer of `model`, their inputs kept by `offloader` (on the device, or copied out). A
    compiled layer's forward is compiled instead of its module call, so the checkpoint runs outside the compiled
    code. Returns how many layers; `uncheckpoint_layers` undoes it."""
    layers = decoder_layers(model)
    device = offloader.device
    rng = (any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
           or getattr(getattr(causal_lm(model), "config", None), "attention_dropout", 0) > 0)
    for i, layer in enumerate(layers):
        compiled_call = getattr(layer, "_compiled_call_impl", None)
        run = layer.forward
        if compiled_call is not None:
            run = torch.compile(run)  # what Module.compile does to the module call, one level down
            layer._compiled_call_impl = None
        anchor = torch.zeros((), device=device, requires_grad=True)
        state = Checkpointed(i, run, offloader, rng, anchor, compiled_call,
                             bool(getattr(layer, "gradient_checkpointing", False)))
        if state.hf_checkpointing:
            layer.gradient_checkpointing = False  # transformers' checkpointing would recompute the recomputation
        vars(layer)["tunesmith_checkpointed"] = state
        replace_forward(layer, _checkpointed_forward, Checkpoint.name)
    return len(layers)


def uncheckpoint_layers(model: torch.nn.Module) -> torch.nn.Module:
    """What `checkpoint_layers` did, undone: the layers' own forwards, compiled module calls and flags again."""
    for layer in decoder_layers(model):
        state = vars(layer).pop("tunesmith_checkpointed", None)
        if state is None:
            continue
        restore_forward(layer, Checkpoint.name)
        if state.compiled_call is not None:
            layer._compiled_call_impl = state.compiled_call
        if state.hf_checkpointing:
            layer.gradient_checkpointing = True
    return model


class Checkpoint:
    """--gradient-checkpointing on or offload: tunesmith's checkpointed layers (with --fast-paths auto; offload also
    with it off, being asked for by name); one process, not FSDP2, whose hooks wrap each layer."""

    name = "checkpointed layers"
    tolerance = 1e-5  # the same functions, recomputed

    def applies(self, setting: Setting, model) -> bool:
        ckpt = getattr(setting.cfg, "gradient_checkpointing", False)
        return bool(ckpt) and setting.world == 1 and not setting.fsdp and (setting.auto or ckpt == "offload")

    def apply(self, model, setting: Setting) -> str | None:
        device = next(model.parameters()).device
        offloader = Offloader(device, setting.cfg.gradient_checkpointing == "offload" and device.type == "cuda")
        if not checkpoint_layers(model, offloader):
            return None
        return "checkpointed layers" + (", inputs in pinned host memory" if offloader.offload else "")

    def undo(self, model) -> None:
        uncheckpoint_layers(model)


PATH = Checkpoint()
