"""`tunesmith serve` under load: N concurrent streaming chat clients (the openai client's async API) against one
client alone, on the built-in SmolLM2-135M-Instruct unless told otherwise.

    python bench/bench_serve.py [--model smollm2-135m-instruct] [--clients 8] [--max-tokens 64] \
        [--parallel 8,1] [--json out.json]

For each --parallel value a server is started as its own process (`tunesmith serve --port 0`), warmed with one
request, then asked:

- alone: one client, one request (the reference: what a single user gets);
- together: --clients clients at once, each a different prompt, greedy, streamed with usage.

Per client: time to first token (request sent -> first text chunk), tokens/s while streaming (completion tokens /
time from the first chunk to the last), and whether the answer is whole (a finish_reason) and equal to what the
same prompt gets alone (greedy answers do not depend on what else is running). In total: completion tokens of all
clients / wall time from the first request to the last answer. --parallel 1 serves the queue one request at a time
(first come, first served); 8 answers up to 8 at once, a token each in turn. The figures go to docs/PERFORMANCE.md.
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
import time

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


def start_server(model: str, parallel: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.Popen([sys.executable, "-m", "tunesmith.cli", "serve", "--model", model, "--port", "0",
                             "--parallel", str(parallel)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
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
    return {"prompt": prompt, "text": "".join(parts), "finish": finish, "tokens": tokens, "sent": sent,
            "ttft": (first or end) - sent, "end": end,
            "tps": (tokens - 1) / (end - first) if first and end > first and tokens > 1 else 0.0}


async def run(url: str, model: str, clients: int, max_tokens: int) -> dict:
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    await one(client, model, "Hello!", 8)  # warm-up: first-call allocations, lazy imports
    alone = [await one(client, model, p, max_tokens) for p in PROMPTS[:clients]]  # each prompt's answer alone
    start = time.perf_counter()
    together = await asyncio.gather(*(one(client, model, p, max_tokens) for p in PROMPTS[:clients]))
    wall = time.perf_counter() - start
    await client.close()
    return {"alone": alone, "together": together, "wall": wall}


def summary(rows: list[dict], wall: float | None = None) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    wall = wall if wall is not None else sum(r["end"] - r["sent"] for r in rows)
    return {"ttft_median": statistics.median(r["ttft"] for r in rows), "ttft_max": max(r["ttft"] for r in rows),
            "tps_median": statistics.median(r["tps"] for r in rows), "tokens": tokens, "total_tps": tokens / wall,
            "complete": sum(bool(r["finish"]) and bool(r["text"]) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--parallel", default="8,1", help="comma-separated --parallel values, one server each")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.clients > len(PROMPTS):
        raise SystemExit(f"--clients at most {len(PROMPTS)}")

    results = {}
    for parallel in [int(p) for p in args.parallel.split(",")]:
        proc, url = start_server(args.model, parallel)
        try:
            served = asyncio.run(run(url, os.path.basename(args.model).removesuffix(".gguf"), args.clients,
                                     args.max_tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        same = sum(a["text"] == t["text"] for a, t in zip(served["alone"], served["together"], strict=True))
        results[parallel] = {"alone": summary(served["alone"]), "together": summary(served["together"],
                                                                                    served["wall"]),
                             "same_as_alone": same, "wall": served["wall"], "clients": served["together"]}

    print(f"\n{args.model}, {args.clients} streaming chat clients, greedy, max_tokens {args.max_tokens}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}\n")
    print("| --parallel | clients | complete | same as alone | TTFT median / max (s) | tok/s per client (median) "
          "| tok/s total | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for parallel, r in results.items():
        a, t = r["alone"], r["together"]
        print(f"| {parallel} | 1 (alone, each prompt in turn) | {a['complete']}/{args.clients} | - | "
              f"{a['ttft_median']:.2f} / {a['ttft_max']:.2f} | {a['tps_median']:.1f} | {a['total_tps']:.1f} | - |")
        print(f"| {parallel} | {args.clients} at once | {t['complete']}/{args.clients} | "
              f"{r['same_as_alone']}/{args.clients} | {t['ttft_median']:.2f} / {t['ttft_max']:.2f} | "
              f"{t['tps_median']:.1f} | {t['total_tps']:.1f} | {r['wall']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "clients": args.clients, "max_tokens": args.max_tokens,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
