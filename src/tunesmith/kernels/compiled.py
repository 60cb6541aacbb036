"""Compiled decoder layers: torch.compile of each layer (regional: the layers share code, so the first one compiles
and the rest reuse it; warm-up stays in seconds, not the minutes of a whole-model compile), replayed as CUDA graphs
where `Setting.graphs` says so.

A small model's step is bound by launching thousands of small kernels, not by running them: CUDA graph trees record
each layer's forward and backward once and then replay them. Compiled layers are for training: evaluation runs them
eagerly (`eager_layers`), and `undo` hands back eager layers, which generate with a KV cache without recompiling.
"""

from __future__ import annotations

import contextlib

import torch

from tunesmith.kernels.base import Setting, causal_lm

# torch.compile's activation memory budget under --recompute (1: keep what the partitioner would; 0: recompute all)
LEAN_BUDGET = 0.9


def _layers(model: torch.nn.Module):
    return causal_lm(model).get_decoder().layers


def compile_layers(model: torch.nn.Module, cuda_graphs: bool = False) -> int:
    """torch.compile each decoder layer in place; `cuda_graphs`: the reduce-overhead mode. Returns how many."""
    layers = _layers(model)
    for layer in layers:
        layer.compile(mode="reduce-overhead" if cuda_graphs else None)
    return len(layers)


def uncompile_layers(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder layers back to eager calls (what `compile_layers` did, undone)."""
    try:
        layers = _layers(model)
    except (AttributeError, TypeError):
        return model
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is not None:
            layer._compiled_call_impl = None
    return model


def recomputing(enabled: bool):
    """While layers compile inside this block, the compiler keeps less for their backward pass: its partitioner
    recomputes cheap elementwise results (a norm's output from its input and 1/rms, SwiGLU's product from the gate
    and up projections, which its own backward keeps anyway) instead of storing them, within LEAN_BUDGET of its
    activation memory; products and attention are still kept. Layers compile at their first call, so the block
    spans the training loop. Compiled code already cached in this process for the same layer code and shapes is
    reused as it was compiled."""
    if not enabled:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=LEAN_BUDGET)


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module):
    """Run the decoder layers eagerly inside the block, compiled again after it.

    CUDA graph trees keep one recording per place in a training step; a forward without gradients in between
    (evaluation) would replay the same layer graph for every layer while an earlier layer's output, still needed,
    lives in the memory the replay writes. Evaluation is a small share of a run: it runs eager."""
    layers = _layers(model)
    saved = [getattr(layer, "_compiled_call_impl", None) for layer in layers]
    for layer in layers:
        layer._compiled_call_impl = None
    try:
        yield model
    finally:
        for layer, impl in zip(layers, saved, strict=True):
            layer._compiled_call_impl = impl


def own_gradients(model: torch.nn.Module) -> None:
    """Copy each gradient that lives in a CUDA graph's memory pool out of it, before the next micro-batch.

    A graphed backward writes its gradients into memory that its next replay writes again; the first micro-batch's
    gradient would be overwritten by the second's before being added to it. Only under CUDA graph trees, and only
    between micro-batches of one step (the optimizer reads the last one's before any replay)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.clone()


class Compile:
    """Compiled decoder layers (--compile auto: on CUDA), as CUDA graphs where `Setting.graphs`."""

    name = "compile"
    tolerance = 1e-4  # the compiler's fused kernels round in another order

    def applies(self, setting: Setting, model) -> bool:
        return setting.compiled

    def apply(self, model, setting: Setting) -> str:
        compile_layers(model, cuda_graphs=setting.graphs)
        return "compiled layers" + (" as CUDA graphs" if setting.graphs else "")

    def undo(self, model) -> None:
        uncompile_layers(model)


PATH = Compile()
