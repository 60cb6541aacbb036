"""Packed micro-batches of .jsonl records (`train --pack-records`) against padded ones, on the CPU.

The built-in Shakespeare as prompt/completion records (a speaker's line as the prompt, the speech as the
completion: records of very different lengths, as real instruction data has), the built-in SmolLM2-135M, the demo's
LoRA, micro-batch 8, the same steps with packing on and off, alternated. Reported: supervised tokens per second,
the rows each run computed, and the two runs' losses (equal to float rounding).

    python bench/packing.py [--steps 12] [--repeats 2] [--json rows.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path


def records_file(folder: Path, limit: int = 2000) -> Path:
    from tunesmith.data import shakespeare_text

    path = folder / "speeches.jsonl"
    speeches = [s.strip() for s in shakespeare_text().split("\n\n") if ":" in s]
    with path.open("w", encoding="utf-8") as f:
        for s in speeches[:limit]:
            speaker, _, speech = s.partition("\n")
            if speech.strip():
                f.write(json.dumps({"prompt": speaker + "\n", "completion": speech.strip()}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    import tunesmith.train as T
    from tunesmith.config import DemoConfig, TrainConfig, fields_of
    from tunesmith.data import load_data
    from tunesmith.models import load_model

    demo = DemoConfig()
    work = Path(tempfile.mkdtemp(prefix="packing-"))
    data_path = records_file(work)
    model0, tok = load_model(demo.model, torch.device("cpu"))
    data = dataclasses.replace(load_data(str(data_path), tok, demo.seq_len, 0.05), valid=[])  # no evaluation
    lengths = [len(ids) for ids, _ in data.train]
    print(f"{len(lengths)} records, {min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}")
    base = TrainConfig(**{f.name: getattr(demo, f.name) for f in fields_of(TrainConfig)})
    rows_seen = {"n": 0}
    collate_packed = T.collate_packed

    def counted(*a):
        out = collate_packed(*a)
        rows_seen["n"] += out["input_ids"].shape[0] if out is not None else len(a[0])
        return out

    T.collate_packed = counted
    results = []
    for rep in range(args.repeats):
        for pack in ("on", "off"):
            model, _ = load_model(demo.model, torch.device("cpu"))
            cfg = dataclasses.replace(base, data=str(data_path), output=str(work / f"{pack}{rep}"), max_steps=args.steps,
                                      batch_size=args.batch, grad_accum=1, eval_every=0, checkpoint_every=0,
                                      time_budget=0.0, min_steps=0, pack_records=pack,
                                      overwrite=True)
            rows_seen["n"] = 0
            t = time.perf_counter()
            r = T.train(cfg, model=model, tokenizer=tok, data=data, progress=False)
            row = {"pack_records": pack, "steps": r.steps, "tokens": r.tokens, "seconds": r.seconds,
                   "tokens_per_s": r.tokens / r.seconds, "rows": rows_seen["n"] if pack == "on" else args.steps * args.batch,
                   "losses": r.losses, "wall_s": time.perf_counter() - t, "peak_gib": r.peak_memory_bytes / 2**30,
                   "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
            results.append(row)
            print(f"pack {pack}: {row['tokens_per_s']:.0f} supervised tok/s, {row['rows']} rows, "
                  f"last loss {r.losses[-1]:.4f}, peak {row['peak_gib']:.2f} GiB", flush=True)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    on = [r for r in results if r["pack_records"] == "on"]
    off = [r for r in results if r["pack_records"] == "off"]
    worst = max(abs(a - b) / abs(b) for x, y in zip(on, off, strict=True) for a, b in zip(x["losses"], y["losses"],
                                                                                          strict=True))
    print(f"losses: on vs off within {worst:.1e} relative at every step")


if __name__ == "__main__":
    main()
