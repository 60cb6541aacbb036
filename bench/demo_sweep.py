"""How fast does the demo's held-out perplexity fall, per optimizer step, for a few LoRA settings?

Steps, not seconds: the curve per step is the same on any device (fp32), so a GPU can size the CPU demo.
    python bench/demo_sweep.py --device cuda --steps 80 --configs "1e-3:q_proj,v_proj" "2e-3:q_proj,v_proj"
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from tunesmith.config import DemoConfig, TrainConfig, fields_of
from tunesmith.data import load_data
from tunesmith.device import resolve_device
from tunesmith.evaluate import evaluate
from tunesmith.models import load_model
from tunesmith.train import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=["1e-3:q_proj,v_proj", "2e-3:q_proj,v_proj"])
    ap.add_argument("--out", default="/tmp/sweep")
    args = ap.parse_args()
    demo = DemoConfig()
    device = resolve_device(args.device)
    print("| lr | targets | steps | ppl before | " + " | ".join(f"@{s}" for s in range(args.eval_every, args.steps + 1, args.eval_every)) + " |")
    for spec in args.configs:
        lr, targets = spec.split(":")
        model, tok = load_model(demo.model, device)
        data = load_data(demo.data, tok, demo.seq_len, demo.val_fraction)
        before = evaluate(model, data.valid, 4, demo.eval_batches, tok.pad_token_id).perplexity
        cfg = TrainConfig(**{f.name: getattr(demo, f.name) for f in fields_of(TrainConfig)})
        cfg = dataclasses.replace(cfg, output=f"{args.out}/{lr}-{targets}", lr=float(lr), lora_targets=targets.split(","),
                                  max_steps=args.steps, time_budget=0.0, eval_every=args.eval_every, device=str(device),
                                  precision="fp32", checkpoint_every=0)
        t = time.perf_counter()
        r = train(cfg, model=model, tokenizer=tok, data=data, progress=False)
        ppls = [f"{ev.perplexity:.2f} ({1 - ev.perplexity / before:.0%})" for _, ev in r.evals]
        print(f"| {lr} | {targets} | {r.steps} | {before:.2f} | " + " | ".join(ppls) + f" |  ({time.perf_counter() - t:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
