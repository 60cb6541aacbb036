"""What an nf4 base costs the built-in SmolLM2-135M, and whether the scales are to blame.

Every decoder linear (not the embedding, the norms or the head) is replaced by its nf4 round trip in one of three
ways, then the demo's held-out perplexity is measured (fp32, the CPU):

- torchao's `to_nf4` (blocks of 64, the scales double-quantized to int8 in groups of up to 256): what
  `train --quantize-base nf4` holds;
- the same 16 NF4 levels with each block's absmax scale kept in fp32 (no double quantization);
- the same with each block's scale chosen among 0.70-0.99 x absmax (and absmax) for the least squared error.

    python bench/nf4_variants.py
"""

from __future__ import annotations

import math
import time

import torch

# The 16 NormalFloat4 levels of the QLoRA paper (and torchao's NF4Tensor)
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def nf4_round(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = blocks / scale[:, None]
    return NF4[(x[..., None] - NF4).abs().argmin(-1)] * scale[:, None]


def nf4_fp32_scales(w: torch.Tensor, block: int = 64, search: bool = False) -> torch.Tensor:
    b = w.reshape(-1, block)
    absmax = b.abs().amax(1).clamp_min(1e-12)
    best = nf4_round(b, absmax)
    err = ((best - b) ** 2).sum(1)
    if search:
        for ratio in torch.linspace(0.70, 0.99, 30):
            q = nf4_round(b, absmax * ratio)
            e = ((q - b) ** 2).sum(1)
            better = e < err
            best[better], err[better] = q[better], e[better]
    return best.reshape(w.shape)


def main() -> None:
    from torchao.quantization import to_nf4

    from tunesmith.config import DemoConfig
    from tunesmith.data import load_data
    from tunesmith.evaluate import evaluate
    from tunesmith.models import load_model

    demo = DemoConfig()
    model, tok = load_model(demo.model, torch.device("cpu"))
    data = load_data(demo.data, tok, demo.seq_len, demo.val_fraction)
    head = model.get_output_embeddings()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}

    def perplexity() -> float:
        return evaluate(model, data.valid, demo.batch_size, demo.eval_batches, tok.pad_token_id).perplexity

    print(f"fp32: held-out perplexity {perplexity():.2f}", flush=True)
    variants = {
        "torchao to_nf4, blocks of 64, double-quantized scales": lambda w: to_nf4(
            w, 64, math.gcd(256, w.numel() // 64)).get_original_weight(),
        "nf4, blocks of 64, fp32 absmax scales": nf4_fp32_scales,
        "nf4, blocks of 64, fp32 least-squares scales": lambda w: nf4_fp32_scales(w, search=True),
    }
    for name, round_trip in variants.items():
        t, sq, n = time.perf_counter(), 0.0, 0
        with torch.no_grad():
            for key, m in linears.items():
                q = round_trip(originals[key]).to(torch.float32)
                sq += float(((q - originals[key]) ** 2).sum())
                n += q.numel()
                m.weight.copy_(q)
            ppl = perplexity()
            for key, m in linears.items():
                m.weight.copy_(originals[key])
        print(f"{name}: weight rmse {(sq / n) ** 0.5:.3e}, held-out perplexity {ppl:.2f} "
              f"({time.perf_counter() - t:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
