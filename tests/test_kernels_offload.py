"""Checkpointed decoder layers (kernels.offload): only each layer's input kept (or copied out), the same loss and
gradients as without checkpointing, undone exactly; the trainer's --gradient-checkpointing on and offload."""

import pytest
import torch

from tunesmith.config import TrainConfig
from tunesmith.evaluate import loss_sum
from tunesmith.kernels import offload
from tunesmith.kernels.base import Setting

from .conftest import tiny_train_config
from .kernel_fixtures import eager_aot_compile, kept_loss_grads, lora_pair


def _batch(tokenizer, rows=2, seq=24):
    ids = torch.randint(3, len(tokenizer), (rows, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("copied", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointed_layers_give_the_same_loss_and_gradients(tokenizer, copied, dropout):
    """Kept on the device (on; offload off CUDA) or copied out and back (offload's bookkeeping, without CUDA's
    streams), with LoRA dropout replayed: the loss and every gradient as without checkpointing."""
    plain, ckpt = lora_pair(tokenizer, dropout=dropout)
    offloader = offload.Offloader(torch.device("cpu"), offload=copied)
    assert offload.checkpoint_layers(ckpt, offloader) == 2
    batch = _batch(tokenizer)
    plain_kept, plain_loss, plain_grads = kept_loss_grads(plain, batch)
    for _ in range(2):  # a second step reuses the slots
        kept, loss, grads = kept_loss_grads(ckpt, batch)
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys() and len(grads) == 2 * 7 * 2
        for name in grads:
            torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-6, atol=1e-9)
    assert all(not slot.pending and slot.back is None for slot in offloader.slots.values())
    assert len(offloader.slots) == (2 if copied else 0)
    # what the forward keeps: far less than without checkpointing; with the inputs copied out, not even those
    assert kept < plain_kept / 4
    hidden_bytes = 2 * 24 * 64 * 4
    if copied:
        assert kept < plain_kept / 4 and all(s.host.numel() * 4 == hidden_bytes for s in offloader.slots.values())


def test_a_graph_dropped_without_backward_frees_its_slots(tokenizer):
    _, model = lora_pair(tokenizer)
    offloader = offload.Offloader(torch.device("cpu"), offload=True)
    offload.checkpoint_layers(model, offloader)
    batch = _batch(tokenizer)
    model.train()
    loss, _ = loss_sum(model, batch)
    assert all(slot.pending for slot in offloader.slots.values())
    second, _ = loss_sum(model, batch)  # a second forward first: its inputs stay on the device
    second.backward()
    loss.backward()  # the first still finds its own inputs
    del loss, second
    assert not any(slot.pending for slot in offloader.slots.values())
    dropped, _ = loss_sum(model, batch)
    del dropped  # an error between forward and backward drops the graph
    assert not any(slot.pending for slot in offloader.slots.values())


def test_evaluation_and_undo_run_the_layers_own_forwards(tokenizer):
    untouched, model = lora_pair(tokenizer)
    before = {id(m): vars(m).get("forward") for m in model.modules()}
    offload.checkpoint_layers(model, offload.Offloader(torch.device("cpu"), offload=True))
    batch = _batch(tokenizer)
    model.eval()
    with torch.no_grad():
        a, _ = loss_sum(model, batch)
        b, _ = loss_sum(untouched.eval(), batch)
    assert torch.equal(a, b)
    offload.uncheckpoint_layers(model)
    assert {id(m): vars(m).get("forward") for m in model.modules()} == before
    assert not any("tunesmith_checkpointed" in vars(m) for m in model.modules())


@pytest.mark.parametrize(("ckpt", "device", "world", "fsdp", "fast_paths", "expected"), [
    (False, "cuda", 1, False, "auto", False),
    (True, "cuda", 1, False, "auto", True),
    ("offload", "cuda", 1, False, "auto", True),
    ("offload", "cpu", 1, False, "auto", True),  # applies; keeps the inputs on the device there
    (True, "cuda", 1, False, "off", False),  # the plain path: transformers' checkpointing
    ("offload", "cuda", 1, False, "off", True),  # asked for by name
    ("offload", "cuda", 2, False, "auto", False),  # DDP and FSDP2 keep transformers' checkpointing
    ("offload", "cuda", 2, True, "auto", False),
])
def test_which_runs_take_the_checkpointed_layers(ckpt, device, world, fsdp, fast_paths, expected, tokenizer):
    setting = Setting(TrainConfig(gradient_checkpointing=ckpt, fast_paths=fast_paths), device, world, fsdp)
    assert offload.PATH.applies(setting, None) is expected


@pytest.mark.parametrize("value", ["on", "offload"])
def test_train_with_checkpointing_matches_the_run_without(tmp_path, tiny_dir, text_file, value):
    """The trainer end to end on the CPU: --gradient-checkpointing on and offload (kept on the device there)
    train the same losses as without, and the run's config keeps the setting."""
    import yaml

    from tunesmith.config import checkpointing_value
    from tunesmith.train import train

    losses = {}
    for ckpt in (False, checkpointing_value(value)):
        cfg = tiny_train_config(tmp_path / str(ckpt), tiny_dir, text_file, max_steps=3, gradient_checkpointing=ckpt)
        losses[ckpt] = train(cfg, progress=False).losses
    assert losses[checkpointing_value(value)] == pytest.approx(losses[False], rel=1e-5)
    saved = yaml.safe_load((tmp_path / str(checkpointing_value(value)) / "run" / "config.yaml").read_text())
    assert checkpointing_value(saved["gradient_checkpointing"]) == checkpointing_value(value)


def test_the_lora_aware_mlp_skips_its_down_projection_when_recomputed(tokenizer, monkeypatch):
    """With the LoRA-aware MLP (its PyTorch reference off CUDA), the recomputation skips the down projection's
    product: once a layer (the forward), not twice; the gradients are the unfused model's."""
    from tunesmith.kernels import lora_mlp

    plain, ckpt = lora_pair(tokenizer)
    assert lora_mlp.fuse_mlp(ckpt) == 2
    offload.checkpoint_layers(ckpt, offload.Offloader(torch.device("cpu"), offload=True))
    calls = []
    real = lora_mlp.products_sum
    monkeypatch.setattr(lora_mlp, "products_sum", lambda mats, alphas: calls.append(len(mats)) or real(mats, alphas))
    batch = _batch(tokenizer)
    _, plain_loss, plain_grads = kept_loss_grads(plain, batch)
    _, loss, grads = kept_loss_grads(ckpt, batch)
    assert calls.count(4) == 2  # the down projection: the two layers' forwards; their recomputations skip it
    assert calls.count(6) == 2  # the input's gradient, in each layer's backward
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)
    assert not lora_mlp._output_unused


def test_compiled_layers_stay_compiled_and_checkpointed(tokenizer, monkeypatch):
    """A compiled layer (compile on, as the trainer compiles them) under the path: its module call is eager, its
    forward compiled (and captured: dynamo's graphs), the gradients the uncompiled model's; undo gives the compiled
    module call back."""
    from tunesmith.kernels import compiled

    eager_aot_compile(monkeypatch)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain, ckpt = lora_pair(tokenizer)
    compiled.compile_layers(ckpt)
    calls = [layer._compiled_call_impl for layer in offload.decoder_layers(ckpt)]
    offload.checkpoint_layers(ckpt, offload.Offloader(torch.device("cpu"), offload=True))
    layers = offload.decoder_layers(ckpt)
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert all(type(vars(layer)["tunesmith_checkpointed"].run).__name__ != "method" for layer in layers)
    batch = _batch(tokenizer)
    _, plain_loss, plain_grads = kept_loss_grads(plain, batch)
    _, loss, grads = kept_loss_grads(ckpt, batch)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    torch._dynamo.reset()
    offload.uncheckpoint_layers(ckpt)
    assert [layer._compiled_call_impl for layer in layers] == calls
