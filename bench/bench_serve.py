"""`tunesmith serve` under load: one client alone, then N streaming chat clients together, over the base only and
mixed over the base and two adapters, on the built-in SmolLM2-135M-Instruct unless told otherwise.

    python bench/bench_serve.py [--model smollm2-135m-instruct] [--clients 12] [--max-tokens 64] \
        [--reference-src DIR] [--json out.json]

One server (`tunesmith serve --port 0 --parallel CLIENTS`, its own process) with two LoRA adapters made for the
run (rank 16 on every linear of every layer, B drawn small and non-zero, so each answers its own way). It is warmed
with one request, then asked:

- alone: each (prompt, model) of the runs below, one request at a time (the reference: what a single user gets),
  half of them before the two runs together and half after (the load of a shared machine drifts);
- base together: CLIENTS clients at once, each a different prompt, all on the base;
- mixed together: the same prompts at once, the models in turn base, adapter a, adapter b.

Per client: time to first token, decode tokens/s (completion tokens after the first / time from the first text
chunk to the last) and whether its answer equals what the same (prompt, model) got alone. In total: completion
tokens of all clients / wall time from the first request to the last answer; "x alone" divides that by the same
figure for the alone requests (tokens / the sum of their times). --reference-src starts a second server beside the
first from another checkout's src/ (the code before a change, say), and asks it each base request alone right after
the first server answers it, so that the two single streams meet the same load on a shared machine: compare its
decode tok/s per client with "alone, base only".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

PROMPTS = [
    "Write two lines about the sea.",
    "What is a sonnet?",
    "Name three plays by Shakespeare.",
    "Describe a rainy morning in one sentence.",
    "Give a short greeting to a king.",
    "What rhymes with night?",
    "Tell me about Romeo in one line.",
    "Say something kind to a friend.",
    "What is iambic pentameter?",
    "Write a line a jester would say.",
    "Why do leaves fall in autumn?",
    "Give a title for a comedy.",
]
ADAPTERS = ("a", "b")


def make_adapters(model: str, folder: Path) -> list[str]:
    """Two LoRA adapters over `model`, as `tunesmith train` saves them, with random non-zero B."""
    import torch

    from tunesmith.lora import attach_lora, save_adapter
    from tunesmith.models import load_model

    paths = []
    for seed, name in enumerate(ADAPTERS):
        base, _ = load_model(model, "cpu", torch.float32)
        torch.manual_seed(seed)
        peft_model = attach_lora(base, rank=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        paths.append(f"{name}={save_adapter(peft_model, folder / name, model)}")
    return paths


def start_server(model: str, parallel: int, adapters: list[str], src: str | None = None):
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    flags = [f for a in adapters for f in ("--adapter", a)]
    proc = subprocess.Popen([sys.executable, "-m", "tunesmith.cli", "serve", "--model", model, "--port", "0",
                             "--parallel", str(parallel), "--device", "cpu", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split(" at ")[1].split()[0]


async def one(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first = None
    parts, finish, usage = [], None, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    return {"model": model, "prompt": prompt, "text": "".join(parts), "finish": finish, "tokens": tokens,
            "sent": sent, "ttft": (first or end) - sent, "end": end,
            "tps": (tokens - 1) / (end - first) if first and end > first and tokens > 1 else 0.0}


async def measure(url: str, runs: dict[str, list[tuple[str, str]]], max_tokens: int, reference: str = "") -> dict:
    """For each run (name -> (model, prompt) per client): every distinct request alone (and each base request alone
    on the reference server, right after), half of them before the runs together and half after, so that a load
    that drifts during the benchmark weighs on both sides alike."""
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    ref = AsyncOpenAI(base_url=reference, api_key="unused", max_retries=0, timeout=600) if reference else None
    for c in (client, ref) if ref else (client,):
        await one(c, runs["base"][0][0], "Hello!", 8)  # warm-up: first-call allocations, lazy imports
    out = {"alone": {}, "reference": []}
    pairs = list(dict.fromkeys(p for pairs in runs.values() for p in pairs))

    async def alone(half):
        for pair in half:
            out["alone"][pair] = await one(client, *pair, max_tokens)
            if ref and pair in runs["base"]:
                out["reference"].append(await one(ref, *pair, max_tokens))

    await alone(pairs[::2])
    for name, together in runs.items():
        start = time.perf_counter()
        rows = await asyncio.gather(*(one(client, m, p, max_tokens) for m, p in together))
        out[name] = {"rows": rows, "wall": time.perf_counter() - start}
    await alone(pairs[1::2])
    await client.close()
    return out


def summary(rows: list[dict], wall: float | None = None, alone: dict | None = None) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    wall = wall if wall is not None else sum(r["end"] - r["sent"] for r in rows)
    same = sum(r["text"] == alone[(r["model"], r["prompt"])]["text"] for r in rows) if alone else len(rows)
    return {"ttft_median": statistics.median(r["ttft"] for r in rows), "ttft_max": max(r["ttft"] for r in rows),
            "tps_median": statistics.median(r["tps"] for r in rows), "tokens": tokens, "total_tps": tokens / wall,
            "complete": sum(bool(r["finish"]) and bool(r["text"]) for r in rows), "same": same, "n": len(rows)}


def table(results: dict[str, dict]) -> None:
    print("| run | clients | complete | same as alone | TTFT median / max (s) | decode tok/s per client (median) "
          "| tok/s total | x alone |")
    print("|---|---|---|---|---|---|---|---|")
    reference = results["alone"]["total_tps"]
    for name, s in results.items():
        clients = "1 at a time" if "alone" in name else f"{s['n']} at once"
        print(f"| {name} | {clients} | {s['complete']}/{s['n']} | {s['same']}/{s['n']} | {s['ttft_median']:.2f} / "
              f"{s['ttft_max']:.2f} | {s['tps_median']:.1f} | {s['total_tps']:.1f} | "
              f"{s['total_tps'] / reference:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reference-src", default="", help="another checkout's src/: its single stream, measured too")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.clients > len(PROMPTS):
        raise SystemExit(f"--clients at most {len(PROMPTS)}")
    base = os.path.basename(args.model).removesuffix(".gguf")
    prompts = PROMPTS[: args.clients]
    models = [base, *ADAPTERS]
    runs = {"base": [(base, p) for p in prompts],
            "mixed": [(models[i % len(models)], p) for i, p in enumerate(prompts)]}

    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(args.model, Path(tmp))
        servers = [start_server(args.model, args.clients, adapters)]
        if args.reference_src:
            servers.append(start_server(args.model, 1, [], args.reference_src))
        try:
            raw = asyncio.run(measure(servers[0][1], runs, args.max_tokens, servers[-1][1] if len(servers) > 1
                                      else ""))
        finally:
            for proc, _ in servers:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)

    results = {"alone": summary([raw["alone"][pair] for pair in dict.fromkeys(p for v in runs.values() for p in v)]),
               "alone, base only": summary([raw["alone"][pair] for pair in runs["base"]])}
    for name in runs:
        results[f"{name} together"] = summary(raw[name]["rows"], raw[name]["wall"], raw["alone"])
    if raw["reference"]:
        results["alone, base only, --reference-src"] = summary(raw["reference"], None, raw["alone"])
    print(f"\n{args.model}, {args.clients} streaming chat clients, greedy, max_tokens {args.max_tokens}, "
          f"mixed: {' / '.join(models)} in turn; {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"CPUs, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}\n")
    table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "clients": args.clients, "max_tokens": args.max_tokens,
                       "results": results, "rows": {k: v["rows"] for k, v in raw.items() if k in runs}}, f,
                      indent=2)


if __name__ == "__main__":
    main()
