"""kernels.rope.rope_qkv: RoPE straight out of the joined q/k/v product and its gradient back into it."""

import os
import subprocess
import sys
import types

import pytest
import torch

from tunesmith.kernels import qkv, rope

CHECK = """
import itertools
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from tunesmith.kernels import rope as R
torch.manual_seed(0)
worst = {torch.float32: 0.0, torch.float16: 0.0}
for (b, s, hq, hk, d, dt), per_row in itertools.product(
        [(2, 37, 4, 2, 16, torch.float32), (1, 64, 3, 1, 32, torch.float16), (3, 5, 2, 2, 8, torch.float32)],
        (True, False)):
    qkv = torch.randn(b * s, (hq + 2 * hk) * d, dtype=dt)
    # positions of each row (packed rows restart them) or one [1, seq] for all
    pos = (torch.arange(s)[None] + torch.arange(b)[:, None] * 3) if per_row else torch.arange(s)[None]
    freqs = pos[..., None].float() * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    ref = R._forward_reference(qkv, cos, sin, b, hq, hk)
    got = R._forward_triton(qkv, cos, sin, b, hq, hk)
    x = qkv.float().view(b, s, -1, d)
    q, k = apply_rotary_pos_emb(x[:, :, :hq].transpose(1, 2), x[:, :, hq:hq + hk].transpose(1, 2), cos.float(),
                                sin.float())
    pairs = list(zip(ref, got, strict=True)) + [(q.transpose(1, 2), ref[0]), (k.transpose(1, 2), ref[1]),
                                                (x[:, :, hq + hk:], ref[2])]
    # gradients in the layout an attention kernel hands back ([b, h, s, d] in memory) and a plain one
    dq = torch.randn(b, hq, s, d, dtype=dt).transpose(1, 2)
    dk = torch.randn(b, hk, s, d, dtype=dt).transpose(1, 2)
    dv = torch.randn(b, s, hk, d, dtype=dt)
    back = R._backward_reference(dq, dk, dv, cos, sin)
    pairs.append((back, R._backward_triton(dq, dk, dv, cos, sin)))
    # transformers' RoPE differentiated by autograd
    xg = x.clone().requires_grad_(True)
    q, k = apply_rotary_pos_emb(xg[:, :, :hq].transpose(1, 2), xg[:, :, hq:hq + hk].transpose(1, 2), cos.float(),
                                sin.float())
    ((q * dq.float().transpose(1, 2)).sum() + (k * dk.float().transpose(1, 2)).sum()
     + (xg[:, :, hq + hk:] * dv.float()).sum()).backward()
    pairs.append((xg.grad.reshape(b * s, -1), back))
    for a, c in pairs:
        assert a.shape == c.shape and c.dtype == dt, (a.shape, c.shape, c.dtype)
        worst[dt] = max(worst[dt], float((a.float() - c.float()).abs().max() / a.float().abs().max()))
print(worst[torch.float32], worst[torch.float16])
"""


def test_the_kernels_equal_the_reference_and_transformers_rope_under_triton_s_interpreter():
    """Forward (q, k rotated, v copied) and backward (dq, dk rotated back, dv copied, into the joined gradient)
    against the PyTorch reference, transformers' apply_rotary_pos_emb and its autograd: fp32 to rounding, fp16 to
    its one rounding; per-row and shared positions; gradients in an attention kernel's transposed layout."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    fp32, fp16 = (float(v) for v in out.stdout.split()[-2:])
    assert fp32 < 1e-5 and fp16 < 2e-3


def test_the_op_s_gradient_is_its_reference_s():
    """The registered backward (rope_qkv_backward) against autograd through the reference's own operations."""
    torch.manual_seed(0)
    qkv = torch.randn(2 * 5, 4 * 8, requires_grad=True)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    weights = [torch.randn(2, 5, n, 8) for n in (2, 1, 1)]
    out = rope.rope_qkv(qkv, cos, sin, 2, 2, 1)
    assert [t.shape for t in out] == [(2, 5, 2, 8), (2, 5, 1, 8), (2, 5, 1, 8)]
    sum((t * w).sum() for t, w in zip(out, weights, strict=True)).backward()
    x = qkv.detach().clone().requires_grad_(True)
    sum((t * w).sum() for t, w in zip(rope._forward_reference(x, cos, sin, 2, 2, 1), weights, strict=True)).backward()
    torch.testing.assert_close(qkv.grad, x.grad)
    torch.testing.assert_close(out[2], qkv.detach().view(2, 5, 4, 8)[:, :, 3:])  # v untouched


def test_rope_kernel_is_used_only_where_it_applies(monkeypatch):
    qkv_out, hidden = torch.zeros(2 * 5, 64), torch.zeros(2, 5, 32)
    cos = torch.zeros(1, 5, 16)
    module = types.SimpleNamespace(apply_rotary_pos_emb=lambda *a: a)
    args = (qkv_out, hidden, cos, module, [32, 16, 16], 16)
    assert not qkv._rope_kernel(*args)  # the CPU: transformers' RoPE
    monkeypatch.setattr(qkv, "ROPE_ON_CPU", True)
    assert qkv._rope_kernel(*args)
    liger = types.SimpleNamespace(apply_rotary_pos_emb=types.SimpleNamespace(_tunesmith_liger=True))
    assert not qkv._rope_kernel(qkv_out, hidden, cos, liger, [32, 16, 16], 16)  # Liger's RoPE stays Liger's
    assert not qkv._rope_kernel(qkv_out, hidden, torch.zeros(1, 5, 8), module, [32, 16, 16], 16)  # partial rotary
    assert not qkv._rope_kernel(qkv_out, hidden, cos, module, [32, 16, 8], 16)  # k and v of different sizes
