"""`tunesmith serve` under load: one client alone, then N streaming chat clients together, over the base only and
mixed over the base and two adapters, on the built-in SmolLM2-135M-Instruct unless told otherwise.

    python bench/bench_serve.py [--model smollm2-135m-instruct | --shape meta-llama/Llama-3.2-1B] [--device cuda] \
        [--clients 12] [--max-tokens 64] [--deterministic] [--reference-src DIR] [--hf-reference] \
        [--llama-cpp f16,q8_0] [--llama-python PYTHON] [--json out.json]

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
figure for the alone requests (tokens / the sum of their times); a line after the table gives it again with every
alone request's time to first token at their median, as one slow first token among the alone requests raises
"x alone". --reference-src starts a second server beside the
first from another checkout's src/ (the code before a change, say), and asks it each base request alone right after
the first server answers it, so that the two single streams meet the same load on a shared machine: compare its
decode tok/s per client with "alone, base only".

llama.cpp's server (llama-cpp-python[server], `python -m llama_cpp.server`) is measured after tunesmith's, on the
same model exported by `tunesmith export --format gguf` to each of --llama-cpp's types (f16 and q8_0, rounded to
nearest as llama-quantize does), with as many threads as CPUs. Its Python server answers one request at a time (a
lock around the model; by default a new request even cuts off the one streaming, which --interrupt_requests False
turns off here, so requests queue and each is answered whole; ggml's extra buffer types are off too, see
LLAMA_SERVER): the same base prompts, rendered by the model's chat
template and sent to /v1/completions (llama-cpp-python picks its own chat format, which may differ), alone then
CLIENTS at once, greedy, streamed. It does not report usage when streaming: its completion tokens are the chunks that
carry text, plus the end token for an answer that stopped (tunesmith's usage counts it too). "same as alone" compares
its answers with its own alone answers. It is skipped, with a message, when --llama-python (default: this Python) has
no llama_cpp.server.

--shape serves random bf16 weights of a known shape (torch.manual_seed(0); nothing is downloaded) with a word-level
tokenizer made for the run (the prompts' words, then a word per remaining id, so any token decodes to text; the
chat template joins the messages' text); the answers are random words, their timing that of the real model.
--hf-reference (the default on CUDA) times transformers' `generate` (greedy, its own KV cache) on the first two
base prompts alone, in this process, after the server has stopped: the plain single stream to compare "alone, base
only" with.
--deterministic starts the server with it (answers that do not depend on the batch). --unfused starts it with its
stacked LoRA's mask and addition as PyTorch's two ops instead of the one Triton kernel it takes where Triton runs
(BatchedLM's `fused`, patched out as --trace patches), to set against the same run with it. --trace runs the server with
its engine's steps, graph captures and garbage collections logged (serve_traced), and prints those that fall while
a request waited for its first token: the first alone request, and each burst together.

--step times the server's forward alone instead, in-process, no HTTP: a decode step of the batched model
(serve.batch.BatchedLM) at 1 and 8 rows, eager against CUDA graphs, and its LoRA over a mixed batch three ways: stacked in
PyTorch's ops, stacked with the mask and addition fused in one Triton kernel (serve.grouped_lora.masked_add; BatchedLM's
`fused`, the server's default where Triton runs), and the grouped Triton kernels (serve.grouped_lora), on random weights of a real shape.

    python bench/bench_serve.py --step [--shape meta-llama/Llama-3.2-1B] [--device cuda] [--runs 7] [--json out.json]

Two LoRA adapters (rank 16 on all seven linears of every layer, B random). Each row sits at position 40 of its own
slot (cache window 256); a step is timed as the median of 7 runs of 30 steps after 5 warm-up steps (CUDA
synchronised around each run). "mixed": the rows' adapters one, two, base in turn. "prefill 64": one 64-token
chunk of adapter one beside 7 decoding rows (mixed), the step a prompt joins with (eager).

--host times the engine's own work instead (serve.engine.Engine with its forward replaced by a stub that returns
fixed logits at once): 8 greedy requests of 128 tokens together, over --model's tokenizer; a step's time is what the
host spends per step beside the model (the queue, each row's token, text, stop rule and emitted response; with the
stub's logits on the CPU, the argmax too). Median of --runs runs. Then the same stubbed engine behind the server's
app, with 1 and 8 streaming clients: the tokens/s the host allows through HTTP (clients in the same process).

    python bench/bench_serve.py --host [--model smollm2-135m-instruct] [--runs 7]

Batch-invariance: 8 prompts of 12 to 19 tokens (adapters one, two, base in turn) decode 32 greedy tokens each alone
(batch of 1), then all 8 together; "same" counts the answers whose tokens are identical, by default and with the
deterministic mode. "graph vs eager": the largest logit difference between the captured step and the packed eager
step on the same 8 rows, relative to the largest logit. Then the same through the engine (serve.engine.Engine in
this process, no HTTP; prompts of 20 to 41 tokens, 64 greedy tokens, adapters base, one, two in turn): each request
alone twice, then the 8 together twice; "alone vs alone" and "together vs together" show whether a run repeats
itself, "alone vs together" whether the batch moves an answer. Before that, whether a step repeats itself at all:
one row (a 30-token prompt, adapter one) decoded 100 greedy steps 4 times over in one batched model, by default
and with the deterministic mode; printed, per repeat, the first step whose logits differ in any bit from the first
run's.
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

from openai import APIConnectionError, AsyncOpenAI

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


def make_adapters(model: str, folder: Path, device: str = "cpu") -> list[str]:
    """Two LoRA adapters over `model`, as `tunesmith train` saves them, with random non-zero B."""
    import torch

    from tunesmith.lora import attach_lora, save_adapter
    from tunesmith.models import load_model

    paths = []
    for seed, name in enumerate(ADAPTERS):
        base, _ = load_model(model, device, torch.float32)
        torch.manual_seed(seed)
        peft_model = attach_lora(base, rank=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        paths.append(f"{name}={save_adapter(peft_model, folder / name, model)}")
    return paths


def random_folder(shape: str, device: str, workdir: Path) -> Path:
    """Random weights of `shape` (bench/common.py) with a tokenizer that decodes every id of its vocabulary."""
    from common import random_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = random_model(shape, device, workdir)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    words = ["<pad>", "<s>", "</s>", "<unk>"]
    words += dict.fromkeys(w for p in PROMPTS for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(p))
    words += [f"w{i}" for i in range(len(words), vocab)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    return folder


def hf_reference(model: str, device: str, prompts: list[str], max_tokens: int, alone: dict) -> list[dict]:
    """transformers' generate, greedy, one prompt at a time (the chat template as the server applies it)."""
    import torch

    from tunesmith.device import resolve_device, resolve_precision, weight_dtype
    from tunesmith.generate import encode_messages
    from tunesmith.models import load_model

    where = resolve_device(device)  # in the server's dtype: bf16 on CUDA, fp32 on the CPU
    hf, tokenizer = load_model(model, where, weight_dtype(where, resolve_precision(where, "auto")))
    hf.eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for i, prompt in enumerate(["Hello!", *prompts[:2]]):  # the first: a warm-up
        ids = torch.tensor([encode_messages(tokenizer, [{"role": "user", "content": prompt}])], device=device)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                              pad_token_id=tokenizer.pad_token_id)
        sync()
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        if i:
            same = text == alone.get((None, prompt), {}).get("text")
            rows.append({"prompt": prompt, "tokens": len(new), "seconds": seconds, "tps": len(new) / seconds,
                         "same": same})
    del hf
    return rows


def start_server(model: str, parallel: int, adapters: list[str], src: str | None = None, device: str = "cpu",
                 deterministic: bool = False, trace: str = "", unfused: bool = False):
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    flags = [f for a in adapters for f in ("--adapter", a)]
    flags += ["--deterministic"] if deterministic else []
    run = ([__file__, "--serve-traced", trace or os.devnull, *(["--unfused"] if unfused else []), "--"] if trace or unfused
           else ["-m", "tunesmith.cli"])
    proc = subprocess.Popen([sys.executable, *run, "serve", "--model", model, "--port", "0",
                             "--parallel", str(parallel), "--device", device, *flags], stdout=subprocess.PIPE,
                            stderr=None if os.environ.get("BENCH_SERVER_LOG") else subprocess.DEVNULL, text=True,
                            env=env)
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split(" at ")[1].split()[0]


def export_gguf(model: str, quant: str, folder: Path) -> Path:
    """`tunesmith export` of `model` to a GGUF of type `quant`, rounded to nearest (as llama-quantize does)."""
    out = folder / f"model-{quant}.gguf"
    subprocess.run([sys.executable, "-m", "tunesmith.cli", "export", "--model", model, "--format", "gguf", "--quant",
                    quant, "--calibration-blocks", "0", "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


# `python -m llama_cpp.server` with ggml's extra buffer types off (llama.cpp's --no-repack; the server has no flag for
# it): on this AMX-capable CPU the repacked q8_0 weights end in a general protection fault in libggml-cpu (q8_0 from
# llama.cpp's own quantizer too), so both types run with the plain CPU kernels.
LLAMA_SERVER = """
import runpy, llama_cpp, llama_cpp.llama
default = llama_cpp.llama_model_default_params
def params():
    p = default()
    p.use_extra_bufts = False
    return p
llama_cpp.llama_model_default_params = llama_cpp.llama.llama_cpp.llama_model_default_params = params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def llama_cpp_missing(python: str) -> str | None:
    """Why llama.cpp's server cannot be measured with `python`, or None when it can."""
    probe = subprocess.run([python, "-c", "import llama_cpp.server.app"], capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["not found"])[-1]
        return (f"llama.cpp's server skipped: {python} has no llama_cpp.server ({last}); pip install "
                "'llama-cpp-python[server]' there, or pass --llama-python a Python that has it")
    return None


def start_llama_server(python: str, gguf: Path, alias: str):
    """llama-cpp-python's OpenAI server on a free port, as many threads as CPUs; (process, base URL)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(os.cpu_count())
    proc = subprocess.Popen([python, "-c", LLAMA_SERVER, "--model", str(gguf), "--model_alias", alias,
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", threads,
                             "--n_threads_batch", threads, "--interrupt_requests", "False", "--verbose", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"llama.cpp's server ended at start (exit {proc.returncode}) on {gguf}")
        try:
            urllib.request.urlopen(f"{url}/models", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("llama.cpp's server did not answer within 60 s")


async def one(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, render=None) -> dict:
    """One streamed greedy request: chat, or with `render` (prompt -> text), a completion of the rendered text."""
    sent = time.perf_counter()
    first = None
    parts, finish, usage = [], None, None
    if render is None:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True})
    else:
        stream = await client.completions.create(model=model, prompt=render(prompt), temperature=0,
                                                 max_tokens=max_tokens, stream=True)
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if render is None else choice.text
            if text:
                first = first or time.perf_counter()
                parts.append(text)
            finish = choice.finish_reason or finish
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else len(parts) + (finish == "stop")  # see the module's docstring
    return {"model": model, "prompt": prompt, "text": "".join(parts), "finish": finish, "tokens": tokens,
            "sent": sent, "ttft": (first or end) - sent, "end": end,
            "tps": (tokens - 1) / (end - first) if first and end > first and tokens > 1 else 0.0}


async def measure(url: str, runs: dict[str, list[tuple[str, str]]], max_tokens: int, reference: str = "",
                  render=None) -> dict:
    """For each run (name -> (model, prompt) per client): every distinct request alone (and each base request alone
    on the reference server, right after), half of them before the runs together and half after, so that a load
    that drifts during the benchmark weighs on both sides alike."""
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    ref = AsyncOpenAI(base_url=reference, api_key="unused", max_retries=0, timeout=600) if reference else None
    for c in (client, ref) if ref else (client,):
        await one(c, runs["base"][0][0], "Hello!", 8, render)  # warm-up: first-call allocations, lazy imports
    out = {"alone": {}, "reference": []}
    pairs = list(dict.fromkeys(p for pairs in runs.values() for p in pairs))

    async def alone(half):
        for pair in half:
            out["alone"][pair] = await one(client, *pair, max_tokens, render)
            if ref and pair in runs["base"]:
                out["reference"].append(await one(ref, *pair, max_tokens))

    await alone(pairs[::2])
    for name, together in runs.items():
        start = time.perf_counter()
        rows = await asyncio.gather(*(one(client, m, p, max_tokens, render) for m, p in together))
        out[name] = {"rows": rows, "wall": time.perf_counter() - start}
    await alone(pairs[1::2])
    await client.close()
    return out


def summary(rows: list[dict], wall: float | None = None, alone: dict | None = None) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    one_at_a_time = wall is None
    wall = wall if wall is not None else sum(r["end"] - r["sent"] for r in rows)
    same = sum(r["text"] == alone[(r["model"], r["prompt"])]["text"] for r in rows) if alone else len(rows)
    ttft = statistics.median(r["ttft"] for r in rows)
    # one slow first token weighs on a sum of requests one at a time: the same total with each at the median
    typical = tokens / (wall - sum(r["ttft"] for r in rows) + ttft * len(rows)) if one_at_a_time else None
    return {"ttft_median": ttft, "ttft_max": max(r["ttft"] for r in rows),
            "tps_median": statistics.median(r["tps"] for r in rows), "tokens": tokens, "total_tps": tokens / wall,
            "total_tps_median_ttft": typical,
            "complete": sum(bool(r["finish"]) and bool(r["text"]) for r in rows), "same": same, "n": len(rows)}


def table(groups: dict[str, dict[str, dict]]) -> None:
    """One row per run; "x alone" is over the same server's "alone" row."""
    print("| server | run | clients | complete | same as alone | TTFT median / max (s) "
          "| decode tok/s per client (median) | tok/s total | x alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for server, results in groups.items():
        reference = results["alone"]["total_tps"]
        for name, s in results.items():
            clients = "1 at a time" if "alone" in name else f"{s['n']} at once"
            print(f"| {server} | {name} | {clients} | {s['complete']}/{s['n']} | {s['same']}/{s['n']} | "
                  f"{s['ttft_median']:.2f} / {s['ttft_max']:.2f} | {s['tps_median']:.1f} | {s['total_tps']:.1f} | "
                  f"{s['total_tps'] / reference:.2f} |")
    for server, results in groups.items():
        typical = results["alone"]["total_tps_median_ttft"]
        print(f"{server}: x alone with every alone request's time to first token at their median: " + ", ".join(
            f"{name} {s['total_tps'] / typical:.2f}" for name, s in results.items() if "together" in name))


def measure_llama_cpp(args, base: list[tuple[str, str]], folder: Path) -> dict[str, dict]:
    """llama.cpp's server on each GGUF type of --llama-cpp: the base requests alone, then together."""
    quants = [q for q in args.llama_cpp.split(",") if q]
    why = llama_cpp_missing(args.llama_python) if quants else None
    if why:
        print(why, file=sys.stderr)
        return {}
    from tunesmith.models import load_tokenizer

    tokenizer = load_tokenizer(args.model)

    def render(prompt: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)

    out = {}
    for quant in quants:
        gguf = export_gguf(args.model, quant, folder)
        proc, url = start_llama_server(args.llama_python, gguf, base[0][0])
        try:
            out[quant] = asyncio.run(measure(url, {"base": base}, args.max_tokens, render=render))
        except APIConnectionError as e:  # its process died: say so, and go on with the next type
            print(f"llama.cpp's server on {quant} failed: {e} (exit {proc.poll()})", file=sys.stderr)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return out


STEP_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_peft(shape: str, device: str):
    """Random bf16 weights of the shape (torch.manual_seed(0)) with LoRA adapters one and two."""
    import torch
    from common import ROPE_THETA, TINY
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunesmith.memory import KNOWN_CONFIGS

    shape_config = TINY if shape == "tiny" else {**KNOWN_CONFIGS[shape], "rope_theta": ROPE_THETA[shape]}
    config = LlamaConfig(**shape_config, rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=STEP_LINEARS)
    model = get_peft_model(model, lora, adapter_name="one")
    model.add_adapter("two", lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.to(torch.bfloat16).eval()  # the adapters too, as the server holds them


def timed(fn, device: str, runs: int = 7, calls: int = 30) -> float:
    """Median seconds per call: `runs` runs of `calls` calls after 5 warm-up calls."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def batch_invariance(model, deterministic: bool, steps: int = 32) -> dict:
    """Greedy tokens of 8 rows decoded alone and together (see the module's docstring)."""
    from tunesmith.serve.batch import BatchedLM

    lm = BatchedLM(model, slots=8, context=4096, deterministic=deterministic)
    prompts = [([10 + 7 * i + j for j in range(12 + i)], (i + 1) % 3) for i in range(8)]
    check = {}

    def decode(rows):  # (slot, prompt, adapter) -> each row's greedy tokens
        logits = lm.forward([(s, p, 0, a) for s, p, a in rows], [True] * len(rows))
        tokens = [[] for _ in rows]
        for step in range(steps):
            for t, n in zip(tokens, logits.argmax(-1).tolist(), strict=True):
                t.append(n)
            batch = [(s, [t[-1]], len(p) + step, a) for (s, p, a), t in zip(rows, tokens, strict=True)]
            if len(rows) > 1 and step == 0 and lm.graphs is not None and not deterministic:
                graphs, lm.graphs = lm.graphs, None
                eager = lm.forward(batch, [True] * len(batch))
                lm.graphs = graphs
                logits = lm.forward(batch, [True] * len(batch))
                check["graph_vs_eager"] = float((logits - eager).abs().max() / eager.abs().max())
            else:
                logits = lm.forward(batch, [True] * len(batch))
        return tokens

    alone = [decode([(0, p, a)])[0] for p, a in prompts]
    together = decode([(s, p, a) for s, (p, a) in enumerate(prompts)])
    diffs = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
             for a, b in zip(alone, together, strict=True)]
    return {"same": sum(d is None for d in diffs), "first_diff": [d for d in diffs if d is not None],
            "graph_vs_eager": check.get("graph_vs_eager", float("nan"))}


def repeats(model, deterministic: bool, steps: int = 100, times: int = 4) -> list[int | None]:
    """One row (adapter one, a 30-token prompt, slot 0) decoded greedily `steps` steps, `times` times over, in one
    batched model of 8 slots: for each repeat after the first, the first step whose logits differ from the first
    run's in any bit (None: none)."""
    import torch

    from tunesmith.serve.batch import BatchedLM

    lm = BatchedLM(model, slots=8, context=4096, deterministic=deterministic)
    runs = []
    for _ in range(times):
        logits, cached, run = lm.forward([(0, [7 + j for j in range(30)], 0, 1)], [True])[0], 30, []
        for _ in range(steps):
            logits = lm.forward([(0, [int(logits.argmax())], cached, 1)], [True])[0]
            run.append(logits.cpu())
            cached += 1
        runs.append(run)
    return [next((k for k, (a, b) in enumerate(zip(runs[0], r, strict=True)) if not torch.equal(a, b)), None)
            for r in runs[1:]]


def engine_invariance(model, deterministic: bool, tokens: int = 64) -> dict:
    """Greedy tokens of 8 requests through the engine (serve.engine.Engine, in this process, no HTTP): each alone,
    twice, then all 8 together, twice (see the module's docstring)."""
    import threading
    import types

    from tunesmith.serve.engine import Engine, Job

    model.generation_config = types.SimpleNamespace(eos_token_id=None)
    tokenizer = types.SimpleNamespace(eos_token_id=None, decode=lambda ids, skip_special_tokens=True: " ".join(
        f"w{i}" for i in ids))
    engine = Engine(model, tokenizer, parallel=8, deterministic=deterministic)
    engine.start()
    prompts = [([10 + 7 * i + j for j in range(20 + 3 * i)], [None, "one", "two"][i % 3]) for i in range(8)]

    def run(indices):
        got, done = {i: [] for i in indices}, threading.Semaphore(0)
        for i in indices:
            def emit(item, i=i):
                if item is None or isinstance(item, BaseException):
                    done.release()
                else:
                    got[i].append(item.token)
            engine.submit(Job(prompts[i][1], prompts[i][0], tokens, 0.0, 1.0, 0, [], emit))
        for _ in indices:
            done.acquire()
        return [got[i] for i in indices]

    try:
        alone = [[run([i])[0] for i in range(8)] for _ in range(2)]
        together = [run(list(range(8))) for _ in range(2)]
    finally:
        engine.close()

    def first_diff(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)

    pairs = {"alone vs alone": (alone[0], alone[1]), "alone vs together": (alone[0], together[0]),
             "together vs together": (together[0], together[1])}
    return {name: {"same": sum(first_diff(x, y) is None for x, y in zip(a, b, strict=True)),
                   "first_diff": [d for x, y in zip(a, b, strict=True) if (d := first_diff(x, y)) is not None]}
            for name, (a, b) in pairs.items()}


def step_main(args) -> None:
    """--step: the batched forward alone (see the module's docstring)."""
    import torch
    from common import L1B, SMOL, versions

    args.shape = args.shape or L1B
    if args.shape not in (SMOL, L1B, "tiny"):
        raise SystemExit(f"--step takes --shape {SMOL}, {L1B} or tiny")
    from tunesmith.serve import grouped_lora
    from tunesmith.serve.batch import BatchedLM
    from tunesmith.serve.graphs import DecodeGraphs

    model = random_peft(args.shape, args.device)
    lms = {"stacked": BatchedLM(model, slots=8, context=4096, fused=False)}  # PyTorch's ops: mul_, addmm_
    if grouped_lora.available(torch.zeros(1, device=args.device)):
        lms["fused"] = BatchedLM(model, slots=8, context=4096, fused=True)  # the mask and addition in one kernel
        lms["grouped"] = BatchedLM(model, slots=8, context=4096, lora_kernel=True)
    paths = {"stacked": "stacked LoRA", "fused": "stacked LoRA, fused mask + add (Triton)",
             "grouped": "grouped LoRA (Triton)"}
    rows = {}
    for n in (1, 8):
        rows[f"base x{n}"] = [(s, [5 + s], 40, 0) for s in range(n)]
        rows[f"mixed x{n}"] = [(s, [5 + s], 40, (s + 1) % 3) for s in range(n)]  # one first: a lone row has an adapter
    prefill = [(0, list(range(5, 69)), 40, 1)] + [(s, [5 + s], 40, s % 3) for s in range(1, 8)]
    out = []

    def record(name, path, seconds, tokens):
        out.append({"step": name, "path": path, "ms": seconds * 1e3, "tok_s": tokens / seconds})
        print(f"| {name} | {path} | {seconds * 1e3:.3f} | {tokens / seconds:.0f} |", flush=True)

    print(f"\n{args.shape}, random bf16 weights, {args.device}"
          f" ({torch.cuda.get_device_name() if args.device == 'cuda' else platform.machine()})\n")
    print("| step | path | ms per step | rows' tokens/s |\n|---|---|---|---|")
    lm = lms["stacked"]
    for name, batch in rows.items():
        graphs = lm.graphs
        lm.graphs = None
        record(name, "eager (packed)", timed(lambda b=batch: lm.forward(b, [True] * len(b)), args.device, args.runs), len(batch))
        lm.graphs = graphs if graphs is not None else DecodeGraphs(lm, capture=False)
        label = "CUDA graph" if lm.graphs.capture else "static step, eager"
        for path, g in lms.items():
            if name.startswith("base") and path != "stacked":
                continue
            record(name, label if name.startswith("base") else f"{label}, {paths[path]}",
                   timed(lambda b=batch, g=g: g.forward(b, [True] * len(b)), args.device, args.runs), len(batch))
    for path, g in lms.items():
        graphs, g.graphs = g.graphs, None
        record("prefill 64 + 7 decoding, mixed", f"eager, {paths[path]}",
               timed(lambda g=g: g.forward(prefill, [True] * 8), args.device, args.runs), 71)
        g.graphs = graphs
    invariance = {mode: batch_invariance(model, mode == "deterministic") for mode in ("default", "deterministic")}
    for mode, r in invariance.items():
        print(f"\nbatch-invariance, {mode}: {r['same']}/8 greedy answers (32 tokens) the same alone and 8 together; "
              f"first differing token at {r['first_diff']}; graph vs eager logits: {r['graph_vs_eager']:.2e}")
    repeated = {mode: repeats(model, mode == "deterministic") for mode in ("default", "deterministic")}
    for mode, r in repeated.items():
        print(f"one row decoded 100 steps 4 times over, {mode}: first step whose logits differ from the first "
              f"run's, per repeat: {r}")
    engine = {mode: engine_invariance(model, mode == "deterministic") for mode in ("default", "deterministic")}
    for mode, r in engine.items():
        print(f"through the engine, {mode} (64 tokens): " + "; ".join(
            f"{name} {v['same']}/8 (first differing tokens {v['first_diff']})" for name, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "invariance": invariance, "repeats": repeated,
                       "engine": engine,
                       "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                       "versions": versions("torch", "transformers", "peft", "triton"), "steps": out}, f, indent=2)


def host_main(args) -> None:
    """--host: the engine's work per step with the forward stubbed (see the module's docstring)."""
    import threading
    import types

    import torch

    from tunesmith.models import load_tokenizer, resolve_model
    from tunesmith.serve.engine import Engine, Job

    tokenizer = load_tokenizer(str(resolve_model(args.model, progress=False)))
    logits = torch.randn(8, len(tokenizer), generator=torch.Generator().manual_seed(0))
    logits[:, tokenizer.eos_token_id] = -1e9  # every answer runs its 128 tokens
    stub = types.SimpleNamespace(adapter_index=lambda name: 0, move=lambda *a: None,
                                 forward=lambda rows, want: logits[: sum(want)])
    model = torch.nn.Linear(1, 1)
    model.generation_config = types.SimpleNamespace(eos_token_id=tokenizer.eos_token_id)
    engine = Engine(model, tokenizer, parallel=8)
    engine._runner = stub
    engine.start()
    done = threading.Semaphore(0)
    prompt = tokenizer("Tell me a story about the sea.")["input_ids"]
    times = []
    for _ in range(args.runs):
        start, steps = time.perf_counter(), engine.steps
        for _ in range(8):
            engine.submit(Job(None, prompt, 128, 0.0, 1.0, 0, [], lambda r: r is None and done.release()))
        for _ in range(8):
            done.acquire()
        times.append((time.perf_counter() - start) / (engine.steps - steps))
    print(f"engine's own work, 8 greedy rows of 128 tokens, {args.model}'s tokenizer: "
          f"{statistics.median(times) * 1e3:.3f} ms a step (median of {args.runs}; runs {min(times) * 1e3:.3f}"
          f"-{max(times) * 1e3:.3f})")
    http_ceiling(engine, model, tokenizer, args.runs)
    engine.close()


def http_ceiling(engine, model, tokenizer, runs: int) -> None:
    """--host, then through HTTP: the same stubbed engine behind the server's app (in this process, on a thread),
    1 and then 8 streaming chat clients of 128 tokens (the openai client, in this process too): the total tokens/s
    the host alone allows, every token's HTTP and client work included."""
    from tunesmith.serve import running
    from tunesmith.serve.api import build_app
    from tunesmith.serve.engine import Served

    async def clients(url: str, n: int) -> float:
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        await one(client, "base", "Tell me a story about the sea.", 128)  # the first request's one-time costs
        rates = []
        for _ in range(runs):
            start = time.perf_counter()
            done = await asyncio.gather(*[one(client, "base", "Tell me a story about the sea.", 128)
                                          for _ in range(n)])
            rates.append(sum(r["tokens"] for r in done) / (time.perf_counter() - start))
        return statistics.median(rates)

    served = Served(model, tokenizer, "base", "stub", {}, 4096)
    with running(build_app(served, engine)) as url:
        for n in (1, 8):
            print(f"through HTTP, {n} streaming client(s), 128 tokens each: "
                  f"{asyncio.run(clients(url, n)):,.0f} tok/s in all (median of {runs})")


def serve_traced(path: str, argv: list[str], unfused: bool = False) -> None:
    """`tunesmith serve` (argv) with the engine's work written to `path` as it happens, a JSON line per event:
    [kind, start, end, detail] in time.perf_counter() seconds (CLOCK_MONOTONIC on Linux: the clients' clock in the
    other process). submit: a request reaches the engine (detail: prompt tokens); step: an eager or single graph
    step (rows, rows still reading their prompt, tokens); ahead: a run of decode steps launched ahead (rows, steps);
    first: a request's first token drawn; capture: a decode graph captured (batch, length, lora); gc: a collection
    (generation). unfused: every BatchedLM the server builds takes fused=False (--unfused)."""
    import gc

    from tunesmith.cli import main as cli_main
    from tunesmith.serve import engine as E
    from tunesmith.serve import graphs as G

    out = open(path, "w", buffering=1)  # noqa: SIM115 - open for the server's life
    clock = time.perf_counter

    def log(kind, start, detail):
        out.write(json.dumps([kind, start, clock(), detail]) + "\n")

    def wrap(cls, name, kind, detail):
        orig = getattr(cls, name)

        def traced(self, *a, **k):
            before, start = detail(self, *a), clock()
            steps = getattr(self, "steps", 0)
            try:
                return orig(self, *a, **k)
            finally:
                if before is not None:
                    log(kind, start, [*before, getattr(self, "steps", 0) - steps])
        setattr(cls, name, traced)

    if unfused:
        from tunesmith.serve import batch as B

        init = B.BatchedLM.__init__
        B.BatchedLM.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "fused": False})
    wrap(E.Engine, "submit", "submit", lambda self, job: [len(job.prompt_ids)])
    wrap(E.Engine, "_step", "step", lambda self, active, free: [
        len(active), sum(not r.answer.generated for r in active), sum(len(r.pending) for r in active)])
    wrap(E.Engine, "_decode_ahead", "ahead", lambda self, active, free: [len(active)])
    wrap(E.Engine, "_draw", "first", lambda self, row, *a: [row.slot] if not row.answer.generated else None)
    wrap(G.DecodeGraphs, "_capture", "capture", lambda self, batch, length, lora: [batch, length, lora])
    pauses = {}
    gc.callbacks.append(lambda phase, info: pauses.__setitem__(info["generation"], clock()) if phase == "start"
                        else log("gc", pauses.pop(info["generation"], clock()), [info["generation"]]))
    sys.argv = ["tunesmith", *argv]
    cli_main()


def traced_windows(path: str, raw: dict) -> dict[str, list]:
    """The trace's events from each window a request waited for its first token in: the first alone request and
    each burst together (from its first request sent to its last first token), times from the window's start."""
    events = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    alone = min(raw["alone"].values(), key=lambda r: r["sent"])
    windows = {"first alone request": (alone["sent"], alone["sent"] + alone["ttft"])}
    for name in ("base", "mixed"):
        rows = raw[name]["rows"]
        windows[f"{name} together"] = (min(r["sent"] for r in rows), max(r["sent"] + r["ttft"] for r in rows))
    out = {}
    for name, (start, end) in windows.items():
        out[name] = [[k, round(s - start, 4), round(e - s, 4), d] for k, s, e, d in events
                     if e >= start and s <= end]
        print(f"\ntrace, {name}: {end - start:.3f} s to the last first token (kind, start, seconds, detail)")
        for row in out[name][:60]:
            print("  ", *row)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--serve-traced"]:  # internal: PATH [--unfused] -- SERVE ARGS (start_server)
        rest = sys.argv[3:]
        return serve_traced(sys.argv[2], rest[rest.index("--") + 1:], unfused=rest[0] == "--unfused")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--shape", default="", help="random weights of this shape instead of --model (see the docstring)")
    ap.add_argument("--device", default="cpu", help="where the server runs: cpu or cuda")
    ap.add_argument("--deterministic", action="store_true", help="serve with --deterministic")
    ap.add_argument("--hf-reference", action=argparse.BooleanOptionalAction, default=None,
                    help="time transformers' generate on each base prompt alone (default: on CUDA)")
    ap.add_argument("--step", action="store_true", help="time the batched forward alone instead (see the docstring)")
    ap.add_argument("--host", action="store_true", help="time the engine's own work instead (see the docstring)")
    ap.add_argument("--runs", type=int, default=7, help="--step: timed runs of 30 steps per row (the median); --host: runs")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reference-src", default="", help="another checkout's src/: its single stream, measured too")
    ap.add_argument("--llama-cpp", default="f16,q8_0",
                    help="GGUF types to measure llama.cpp's server on ('' for none)")
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama-cpp-python[server]")
    ap.add_argument("--json", default="")
    ap.add_argument("--trace", action="store_true",
                    help="log the server's engine steps and print those of the windows before first tokens")
    ap.add_argument("--unfused", action="store_true",
                    help="the server's stacked LoRA takes PyTorch's mask and addition, not the fused kernel it takes "
                         "where Triton runs (BatchedLM fused=False)")
    args = ap.parse_args()
    if args.step:
        return step_main(args)
    if args.host:
        return host_main(args)
    if args.clients > len(PROMPTS):
        raise SystemExit(f"--clients at most {len(PROMPTS)}")
    hf = args.device == "cuda" if args.hf_reference is None else args.hf_reference
    prompts = PROMPTS[: args.clients]

    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            args.model = str(random_folder(args.shape, args.device, Path(tmp)))
        base = os.path.basename(args.model).removesuffix(".gguf")
        models = [base, *ADAPTERS]
        runs = {"base": [(base, p) for p in prompts],
                "mixed": [(models[i % len(models)], p) for i, p in enumerate(prompts)]}
        adapters = make_adapters(args.model, Path(tmp), args.device)
        trace = str(Path(tmp) / "trace.jsonl") if args.trace else ""
        servers = [start_server(args.model, args.clients, adapters, device=args.device,
                                deterministic=args.deterministic, trace=trace, unfused=args.unfused)]
        if args.reference_src:
            servers.append(start_server(args.model, 1, [], args.reference_src, args.device))
        try:
            raw = asyncio.run(measure(servers[0][1], runs, args.max_tokens, servers[-1][1] if len(servers) > 1
                                      else ""))
        finally:
            for proc, _ in servers:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        traced = traced_windows(trace, raw) if trace else {}
        llama = measure_llama_cpp(args, runs["base"], Path(tmp))
        alone_text = {(None if m == base else m, p): r for (m, p), r in raw["alone"].items()}
        reference = hf_reference(args.model, args.device, prompts, args.max_tokens, alone_text) if hf else []

    results = {"alone": summary([raw["alone"][pair] for pair in dict.fromkeys(p for v in runs.values() for p in v)]),
               "alone, base only": summary([raw["alone"][pair] for pair in runs["base"]])}
    for name in runs:
        results[f"{name} together"] = summary(raw[name]["rows"], raw[name]["wall"], raw["alone"])
    if raw["reference"]:
        results["alone, base only, --reference-src"] = summary(raw["reference"], None, raw["alone"])
    groups = {"tunesmith serve": results}
    for quant, got in llama.items():
        groups[f"llama.cpp server, {quant}"] = {
            "alone": summary([got["alone"][pair] for pair in runs["base"]]),
            "base together": summary(got["base"]["rows"], got["base"]["wall"], got["alone"])}
    where = (gpu_name() if args.device == "cuda" else
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
             f"{os.environ.get('OMP_NUM_THREADS', 'default')}, OMP_WAIT_POLICY "
             f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; load average "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print(f"\n{args.shape or args.model}{' (random weights)' if args.shape else ''}, {args.clients} streaming chat "
          f"clients, greedy, max_tokens {args.max_tokens}, mixed: {' / '.join(models)} in turn"
          f"{', --deterministic' if args.deterministic else ''}{', LoRA addition unfused' if args.unfused else ''}; "
          f"{args.device}: {where}\n")
    table(groups)
    if reference:
        print(f"\ntransformers generate, one base prompt at a time: {statistics.median(r['tps'] for r in reference):.1f}"
              f" tok/s (median of {len(reference)}; tokens / time, prompt included); same text as the server's "
              f"alone answer: {sum(r['same'] for r in reference)}/{len(reference)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.shape or args.model, "device": args.device, "where": where,
                       "deterministic": args.deterministic, "unfused": args.unfused, "clients": args.clients,
                       "max_tokens": args.max_tokens,
                       "results": groups, "hf_generate": reference,
                       "rows": {k: v["rows"] for k, v in raw.items() if k in runs},
                       "alone_rows": [{"model": m, "prompt": p, **r} for (m, p), r in raw["alone"].items()],
                       "llama_cpp_rows": {q: v["base"]["rows"] for q, v in llama.items()}, "trace": traced}, f,
                      indent=2)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
