"""The fused loss (kernels.loss) and Liger's (kernels.liger_loss) against the full-logits loss they replace."""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tunesmith.data import IGNORE
from tunesmith.evaluate import loss_sum
from tunesmith.kernels import liger_loss, loss
from tunesmith.lora import attach_lora

from .conftest import make_model
from .kernel_fixtures import make_batch


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("chunk_rows", [1, 4, 100])
def test_linear_cross_entropy_equals_the_full_logits_path_value_and_gradients(softcap, chunk_rows):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, requires_grad=True)
    weight = torch.randn(37, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 37, (11,), generator=g)
    logits = hidden @ weight.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    ref = F.cross_entropy(logits, targets, reduction="sum")
    (ref * 0.7).backward()  # a scaled loss: backward must carry the incoming gradient
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got = loss.linear_cross_entropy_sum(hidden, weight, targets, softcap, chunk_rows)
    (got * 0.7).backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w, rtol=1e-5, atol=1e-6)


def test_a_frozen_weight_gets_no_gradient_and_no_rows_give_zero():
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(9, 8)
    loss.linear_cross_entropy_sum(hidden, weight, torch.arange(5), rows=2).backward()
    assert weight.grad is None and hidden.grad.shape == hidden.shape
    empty = torch.zeros(0, 8, requires_grad=True)
    assert loss.linear_cross_entropy_sum(empty, weight, torch.zeros(0, dtype=torch.long)).item() == 0.0


def _with_host_rows(model, batch):
    """chunked_loss_sum given the supervised rows found on the host, as train hands them on CUDA."""
    return loss.chunked_loss_sum(model, {**batch, "rows": loss.supervised_rows(batch["labels"])})


@pytest.mark.parametrize("rows", ["mask", "host"])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_sum_equals_loss_sum_on_a_lora_model(tokenizer, monkeypatch, tied, rows):
    monkeypatch.setattr(loss, "DEFAULT_CHUNK_BYTES", 5 * len(tokenizer) * 4)  # 16 rows a chunk: several chunks
    model = attach_lora(make_model(tokenizer, tie_word_embeddings=tied), 4, 8, 0.0, ["q_proj", "v_proj"])
    assert loss.supports_chunked_loss(model)
    batch = make_batch(tokenizer)
    grads = []
    for fn in (loss_sum, loss.chunked_loss_sum if rows == "mask" else _with_host_rows):
        model.zero_grad(set_to_none=True)
        total, n = fn(model, batch)
        (total / n).backward()
        grads.append((total.item(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_n, ref_g), (got, got_n, got_g) = grads
    assert got_n == ref_n == 3 * 11 - 4 - 3  # 11 targets a row, less the prompt's 4 and the padding's 3
    assert got == pytest.approx(ref, rel=1e-6)
    assert ref_g.keys() == got_g.keys() and len(ref_g) == 8
    for k in ref_g:
        torch.testing.assert_close(got_g[k], ref_g[k], rtol=1e-4, atol=1e-7)


def test_host_rows_of_a_batch_without_padding_select_nothing_and_give_the_same_loss(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    batch = make_batch(tokenizer)
    batch["labels"] = batch["input_ids"].clone()  # every next token supervised
    rows = loss.supervised_rows(batch["labels"])
    assert rows.tolist() == list(range(3 * 11))
    ref, ref_n = loss_sum(model, batch)
    got, got_n = _with_host_rows(model, batch)
    assert got_n == ref_n == 33 and got.item() == pytest.approx(ref.item(), rel=1e-6)


def test_lora_on_the_output_layer_keeps_the_plain_loss(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "lm_head"])
    assert not loss.supports_chunked_loss(model)


def test_under_bf16_autocast_the_chunked_loss_stays_close(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    batch = make_batch(tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = loss_sum(model, batch)
        got, _ = loss.chunked_loss_sum(model, batch)
    assert got.item() == pytest.approx(ref.item(), rel=2e-3)


# ------------------------------------------------------------------------------------------------ packed records


def _records(tokenizer, lengths=(12, 5, 4, 3, 9, 2)):
    g = torch.Generator().manual_seed(3)
    out = []
    for n in lengths:
        ids = torch.randint(3, len(tokenizer), (n,), generator=g).tolist()
        out.append((ids, [IGNORE] * (n // 3) + ids[n // 3:]))  # a prompt part, not trained on
    return out


@pytest.mark.parametrize("fn", ["plain", "chunked"])
def test_packed_records_give_the_padded_loss_and_gradients(tokenizer, fn):
    from tunesmith.data import collate, collate_packed

    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    loss_fn = loss_sum if fn == "plain" else loss.chunked_loss_sum
    records = _records(tokenizer)
    packed = collate_packed(records, tokenizer.pad_token_id)
    assert packed["input_ids"].shape == (3, 12)  # 6 records in 3 rows: 12 | 9+3 | 5+4+2
    results = []
    for batch in (collate(records, tokenizer.pad_token_id), packed):
        model.zero_grad(set_to_none=True)
        total, n = loss_fn(model, batch)
        total.backward()
        results.append((total.item(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_n, ref_g), (got, got_n, got_g) = results
    assert got_n == ref_n == sum(sum(1 for t in lab[1:] if t != IGNORE) for _, lab in records)
    assert got == pytest.approx(ref, rel=1e-5)
    for k in ref_g:
        torch.testing.assert_close(got_g[k], ref_g[k], rtol=1e-4, atol=1e-6, msg=k)


def test_a_packed_record_attends_only_to_itself(tokenizer):
    from tunesmith.data import collate_packed

    model = make_model(tokenizer).eval()
    records = _records(tokenizer, (6, 3, 2))
    a = collate_packed(records, tokenizer.pad_token_id)
    changed = [records[0], ([5] * 3, records[1][1]), records[2]]  # the record before the last one in its row
    b = collate_packed(changed, tokenizer.pad_token_id)
    with torch.no_grad():
        la = model(**{k: v for k, v in a.items() if k != "labels"}, use_cache=False).logits
        lb = model(**{k: v for k, v in b.items() if k != "labels"}, use_cache=False).logits
    assert a["input_ids"][1].tolist()[3:5] == records[2][0]  # row 1: the 3-token record, then the 2-token one
    torch.testing.assert_close(la[1, 3:5], lb[1, 3:5])  # the 2-token record does not see its neighbour
    assert (la[1, :3] - lb[1, :3]).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------------ Liger's loss


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's Triton kernels run on CUDA")
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("train_head", [False, True])
def test_liger_s_linear_cross_entropy_equals_the_chunked_one_on_cuda(softcap, train_head):
    pytest.importorskip("liger_kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(5000, 64, device="cuda", generator=g, dtype=torch.bfloat16) * 0.3).requires_grad_(train_head)
    targets = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    ref = loss.linear_cross_entropy_sum(hidden, weight, targets, softcap)
    (ref * 0.5).backward()
    ref_h, ref_w, hidden.grad, weight.grad = hidden.grad.clone(), weight.grad, None, None
    got = liger_loss.linear_cross_entropy_sum(hidden, weight, targets, softcap)
    (got * 0.5).backward()
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(ref.item(), rel=1e-3)
    pairs = [(hidden.grad, ref_h)] + ([(weight.grad, ref_w)] if train_head else [])
    for a, b in pairs:
        assert a.dtype == b.dtype
        assert F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) > 0.999


LIGER_LOSS_CHECK = """
import torch
from tunesmith.kernels import liger_loss, loss
liger_loss.LIGER_ON_CPU = True  # Liger's kernels on CPU tensors, run by Triton's interpreter
def no_host_read(*a, **k):
    raise AssertionError("a read to the host inside the loss")
torch.Tensor.item, torch.equal = no_host_read, no_host_read
torch.manual_seed(0)
worst = 0.0
for rows, chunk in ((37, 8), (16, 16), (5, 64)):
    hidden = torch.randn(rows, 24, requires_grad=True)
    weight = torch.randn(301, 24) * 0.3
    targets = torch.randint(0, 301, (rows,))
    ref = loss.linear_cross_entropy_sum(hidden, weight, targets, rows=chunk)
    (ref / 7).backward()
    ref_grad, hidden.grad = hidden.grad, None
    got = liger_loss._LigerLinearCrossEntropy.apply(hidden, weight, targets, 0.0, chunk)
    (got / torch.tensor(7.0)).backward()  # the scale comes as a tensor, as the trainer's 1 / tokens does
    assert got.dtype == torch.float32
    worst = max(worst, abs(float(got.detach()) - float(ref.detach())) / abs(float(ref.detach())),
                float((hidden.grad - ref_grad).abs().max() / ref_grad.abs().max()))
# an ignored row: no loss, no gradient
hidden = torch.randn(6, 24, requires_grad=True)
targets = torch.randint(0, 301, (6,))
targets[2] = -100
got = liger_loss._LigerLinearCrossEntropy.apply(hidden, weight, targets, 0.0, 4)
got.backward()
assert float(hidden.grad[2].abs().max()) == 0.0 and float(hidden.grad[3].abs().max()) > 0
keep = torch.tensor([0, 1, 3, 4, 5])
ref = loss.linear_cross_entropy_sum(hidden.detach()[keep], weight, targets[keep])
worst = max(worst, abs(float(got.detach()) - float(ref)) / abs(float(ref)))
# the frozen-head path of Liger's linear_cross_entropy_sum is this loop
hidden.grad = None
liger_loss.linear_cross_entropy_sum(hidden[keep], weight, targets[keep]).backward()
assert float(hidden.grad[2].abs().max()) == 0.0
print(worst)
"""


def test_liger_s_loss_kernel_without_host_reads_equals_the_chunked_loss_under_triton_s_interpreter():
    """tunesmith's loop over Liger's cross-entropy kernel (the frozen output layer's path): the chunked loss's value
    and hidden-state gradient in fp32, chunks that do not divide the rows included, ignored rows left out, and no
    `.item()` or `torch.equal` anywhere (each is a wait for the GPU on CUDA)."""
    pytest.importorskip("triton")
    pytest.importorskip("liger_kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", LIGER_LOSS_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-5


def test_liger_s_loss_kernel_of_another_signature_is_not_called(monkeypatch, request):
    pytest.importorskip("liger_kernel")
    liger_loss._liger_kernels.cache_clear()
    request.addfinalizer(liger_loss._liger_kernels.cache_clear)  # the lookup is cached a process
    assert liger_loss._liger_kernels() is not None
    liger_loss._liger_kernels.cache_clear()
    monkeypatch.setattr(liger_loss, "LIGER_CE_ARGS", liger_loss.LIGER_CE_ARGS[:-1])
    assert liger_loss._liger_kernels() is None  # linear_cross_entropy_sum then takes Liger's public function


def test_liger_s_loss_off_cuda_is_the_plain_chunks():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(13, 8, generator=g)
    targets = torch.randint(0, 13, (9,), generator=g)
    assert torch.equal(liger_loss.linear_cross_entropy_sum(hidden, weight, targets),
                       loss.linear_cross_entropy_sum(hidden, weight, targets))


@pytest.mark.parametrize("rows, hidden, vocab, const, chunk", [
    (8192, 4096, 128256, 8, 2048),  # the Llama-3.1-8B row: Liger's default would take 256 rows at a time
    (16384, 2048, 128256, 8, 2048),  # Llama-3.2-1B, seq 2048, micro-batch 8
    (8192, 576, 49152, 64, 4096),  # SmolLM2-135M: the budget holds 5,461 rows; 64 is the largest tried
    (300, 4096, 5000, 64, 300),  # one chunk: never more rows than there are
])
def test_liger_s_chunks_take_the_cuda_chunk_budget(rows, hidden, vocab, const, chunk):
    assert liger_loss.liger_chunk_const(rows, hidden, vocab) == const
    # Liger 0.8.5's rule (ops/fused_linear_cross_entropy.py), written out: the chunk it then takes
    parts = -(-vocab // (const * hidden))
    got = min(2 ** math.ceil(math.log2(-(-rows // parts))), rows)
    assert got == chunk == liger_loss.liger_chunk_rows(rows, hidden, vocab)  # what tunesmith's own loop takes
    assert got * vocab * 2 <= loss.CHUNK_BYTES["cuda"]  # bf16 logits within the planner's chunk budget
