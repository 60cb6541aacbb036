"""Compiled decoder layers (kernels.compiled): eager for evaluation and once undone, gradients out of a CUDA graph's
pool between micro-batches, and the compiler's recomputation."""

import torch

from tunesmith.evaluate import loss_sum
from tunesmith.kernels import compiled
from tunesmith.lora import attach_lora

from .conftest import make_model
from .kernel_fixtures import lora_model


def test_compiled_layers_run_eagerly_for_evaluation_and_after_training(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, "all-linear")
    assert compiled.compile_layers(model, cuda_graphs=True) == 2  # torch.compile is lazy: nothing compiles yet
    layers = model.get_base_model().model.layers
    impls = [layer._compiled_call_impl for layer in layers]
    assert all(c is not None for c in impls)
    with compiled.eager_layers(model):
        assert all(layer._compiled_call_impl is None for layer in layers)
    assert [layer._compiled_call_impl for layer in layers] == impls
    compiled.PATH.undo(model)
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert compiled.uncompile_layers(model) is model


def test_gradients_leave_the_graph_pool_between_micro_batches_only(tokenizer, monkeypatch):
    """A graphed backward writes its gradients where its next replay writes again: between micro-batches of one
    step they are copied out (values unchanged); after the step's last one the optimizer reads them in place."""
    from accelerate import Accelerator

    import tunesmith.train as T

    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.grad for p in params]
    compiled.own_gradients(model)
    assert all(p.grad is not b and p.grad.data_ptr() != b.data_ptr() and torch.equal(p.grad, b)
               for p, b in zip(params, before, strict=True))
    model.zero_grad(set_to_none=True)

    calls = []
    monkeypatch.setattr(T, "own_gradients", lambda m: calls.append(m))
    g = torch.Generator().manual_seed(0)
    examples = [(ids, ids) for ids in (torch.randint(3, len(tokenizer), (16,), generator=g).tolist()
                                       for _ in range(4))]
    acc = Accelerator(cpu=True)
    graphed = T._accumulate(model, acc, examples, 1, 60, 0, loss_sum, graphed=True)
    grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    assert len(calls) == 3  # 4 micro-batches: after the first three
    plain = T._accumulate(model, acc, examples, 1, 60, 0, loss_sum, graphed=False)
    assert len(calls) == 3 and float(graphed) == float(plain)
    assert all(torch.equal(p.grad, q) for p, q in zip(params, grads, strict=True))


def _saved_and_grads(model, batch, recompute):
    """Bytes the compiled decoder layers keep for backward (parameters aside) and the LoRA gradients."""
    torch._dynamo.reset()  # compiled code is cached per layer code and shapes: each case compiles afresh
    params = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.data_ptr() not in params:
            kept[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    compiled.compile_layers(model)
    try:
        with compiled.recomputing(recompute), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = loss_sum(model, batch)
        loss.backward()
    finally:
        compiled.uncompile_layers(model)
        torch._dynamo.reset()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return sum(kept.values()), grads


def test_recomputing_keeps_less_and_gives_the_same_gradients(tokenizer):
    model = lora_model(tokenizer)
    ids = torch.randint(3, len(tokenizer), (2, 48))
    batch = {"input_ids": ids, "labels": ids.clone()}
    plain_bytes, plain = _saved_and_grads(model, batch, False)
    lean_bytes, lean = _saved_and_grads(model, batch, True)
    # what goes, at least: each layer's SwiGLU product (the down projection's input) and a normed input (fp32,
    # hidden 64, intermediate 128, 2 x 48 tokens, 2 layers); measured: those and three of the four normed inputs
    assert plain_bytes - lean_bytes >= 2 * (128 + 64) * 2 * 48 * 4
    assert plain.keys() == lean.keys() and len(plain) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    for name in plain:
        torch.testing.assert_close(lean[name], plain[name], rtol=1e-4, atol=1e-6)
