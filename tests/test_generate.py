import pytest
import torch

from tunesmith.errors import TunesmithError
from tunesmith.generate import decode, encode_prompt, generate, sample_next, stream_generate


def test_greedy_matches_transformers_generate(tiny_model, tokenizer):
    prompt = "ROMEO:"
    ours = list(stream_generate(tiny_model, tokenizer, prompt, max_tokens=12))
    ids = torch.tensor([encode_prompt(tokenizer, prompt)])
    ref = tiny_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert [r.token for r in ours] == ref[0, ids.shape[1] :].tolist()


def test_streamed_text_concatenates_to_the_decoded_tokens(tiny_model, tokenizer):
    responses = list(stream_generate(tiny_model, tokenizer, "JULIET:", max_tokens=10, temperature=1.0, seed=3))
    tokens = [r.token for r in responses if r.token != tokenizer.eos_token_id]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens, skip_special_tokens=True)
    last = responses[-1]
    assert last.finish_reason in ("stop", "length") and last.generated_tokens == len(responses)
    assert last.generation_tps > 0 and last.prompt_tokens == len(encode_prompt(tokenizer, "JULIET:"))


def test_sampling_is_repeatable_per_seed(tiny_model, tokenizer):
    a = generate(tiny_model, tokenizer, "ROMEO:", max_tokens=15, temperature=1.0, seed=7)
    b = generate(tiny_model, tokenizer, "ROMEO:", max_tokens=15, temperature=1.0, seed=7)
    c = generate(tiny_model, tokenizer, "ROMEO:", max_tokens=15, temperature=1.0, seed=8)
    assert a == b and a != c


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    drawn = {sample_next(logits, 1.0, 0.7, g) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reach 0.7; the tail is never drawn
    assert sample_next(logits, 0.0, 1.0, None) == 0


def test_max_tokens_and_stop_token(tiny_model, tokenizer):
    assert len(list(stream_generate(tiny_model, tokenizer, "a", max_tokens=3))) == 3
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 100.0  # force end-of-sequence first
    with torch.no_grad():
        tiny_model.lm_head.bias = torch.nn.Parameter(bias)
    out = list(stream_generate(tiny_model, tokenizer, "a", max_tokens=20))
    assert len(out) == 1 and out[0].finish_reason == "stop" and out[0].text == ""


def test_chat_uses_the_template(tokenizer):
    ids = encode_prompt(tokenizer, "hello", chat=True)
    assert tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_chat_puts_the_system_message_first(tokenizer):
    ids = encode_prompt(tokenizer, "hello", chat=True, system="Be brief.")
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(TunesmithError, match="add --chat"):
        encode_prompt(tokenizer, "hello", system="Be brief.")


def test_bad_arguments(tiny_model, tokenizer):
    with pytest.raises(TunesmithError, match=r"--top-p must be in \(0, 1\], got 0"):
        list(stream_generate(tiny_model, tokenizer, "a", top_p=0.0))
    with pytest.raises(TunesmithError, match="--max-tokens must be >= 1, got 0"):
        list(stream_generate(tiny_model, tokenizer, "a", max_tokens=0))
    with pytest.raises(TunesmithError, match="--temperature must be >= 0, got -1"):
        list(stream_generate(tiny_model, tokenizer, "a", temperature=-1.0))


class Scripted:
    """A next-logits function that answers with a fixed token sequence and records where it was asked."""

    def __init__(self, answers: list[int], vocab: int):
        self.answers, self.vocab, self.calls = list(answers), vocab, []

    def __call__(self, tokens: list[int], start: int) -> torch.Tensor:
        self.calls.append((list(tokens), start))
        logits = torch.zeros(self.vocab)
        logits[self.answers.pop(0)] = 1.0
        return logits


def test_decode_feeds_each_token_at_its_position_and_stops_on_a_stop_token(tokenizer):
    """The one loop both eager models and .pte programs run: prefill at 0, then token n at len(prompt) + n - 1."""
    prompt = encode_prompt(tokenizer, "ROMEO:")
    a, b = tokenizer.encode("soft")[0], tokenizer.encode(" light")[0]
    stop = tokenizer.eos_token_id
    script = Scripted([a, b, stop, a], len(tokenizer))
    out = list(decode(script, tokenizer, prompt, {stop}, max_tokens=10, peak_memory=lambda: 123))
    assert script.calls == [(prompt, 0), ([a], len(prompt)), ([b], len(prompt) + 1)]
    assert [r.token for r in out] == [a, b, stop] and [r.finish_reason for r in out] == [None, None, "stop"]
    assert "".join(r.text for r in out) == tokenizer.decode([a, b]) and out[-1].peak_memory_bytes == 123
    assert out[-1].prompt_tokens == len(prompt) and out[-1].generated_tokens == 3

    script = Scripted([a, b, a], len(tokenizer))
    out = list(decode(script, tokenizer, prompt, {stop}, max_tokens=2))
    assert len(script.calls) == 2 and out[-1].finish_reason == "length"


def test_stream_generate_is_decode_over_the_eager_model(tiny_model, tokenizer):
    from tunesmith.generate import eager_next_logits

    prompt = encode_prompt(tokenizer, "JULIET:")
    ours = [r.token for r in stream_generate(tiny_model, tokenizer, "JULIET:", max_tokens=8, temperature=0.9, seed=4)]
    loop = [r.token for r in decode(eager_next_logits(tiny_model), tokenizer, prompt, set(), max_tokens=8,
                                    temperature=0.9, seed=4)]
    assert ours and loop[: len(ours)] == ours  # ours ends at end-of-sequence; the bare loop was given no stop


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed(tokenizer):
    """Text that could begin a stop string is held back; once the stop string is whole, the text ends before it."""
    ids = tokenizer.encode("But soft, what light through yonder window breaks?")
    prompt = encode_prompt(tokenizer, "ROMEO:")
    full = tokenizer.decode(ids)
    out = list(decode(Scripted([*ids], len(tokenizer)), tokenizer, prompt, set(), max_tokens=len(ids),
                      stop=["yonder"]))
    assert "".join(r.text for r in out) == full[: full.index("yonder")]
    assert out[-1].finish_reason == "stop" and len(out) < len(ids)  # stopped at the token that completed it

    out = list(decode(Scripted([*ids], len(tokenizer)), tokenizer, prompt, set(), max_tokens=len(ids),
                      stop=["yonder door", "xyz"]))  # begun, then broken: the held-back text comes after all
    assert "".join(r.text for r in out) == full and out[-1].finish_reason == "length"


def test_stop_strings_over_the_eager_model_cut_where_the_plain_text_has_them(tiny_model, tokenizer):
    plain = generate(tiny_model, tokenizer, "ROMEO:", max_tokens=20)
    word = plain[len(plain) // 2 : len(plain) // 2 + 2]
    cut = generate(tiny_model, tokenizer, "ROMEO:", max_tokens=20, stop=[word])
    assert word and cut == plain[: plain.index(word)]


def test_a_conversation_goes_through_the_chat_template(tokenizer):
    from tunesmith.generate import encode_messages

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}]
    assert tokenizer.decode(encode_messages(tokenizer, messages)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama's, Gemma's decoders: "▁" for a space, a character's UTF-8 bytes as
    tokens where the vocabulary lacks it), made in code."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁",
              *(chr(c) for c in range(33, 127)), "▁t", "he", "▁the", "▁q", "▁qu", "ic", "ick", "▁quick"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "q"), ("▁q", "u"), ("i", "c"), ("ic", "k"), ("▁qu", "ick")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_streamed_text_is_the_whole_decode_and_each_token_decodes_a_few(tokenizer, kind, monkeypatch):
    """The text streamed token by token is what one decode of every token gives, for words, characters of several
    bytes split over tokens, runs of spaces, random text, and (byte-level) random ids; and each token decodes a
    window of a few tokens, not the whole answer so far. (Random ids are no test for a byte-fallback decoder: a
    byte that breaks a run of byte tokens turns the whole run into U+FFFD, text streamed already included.)"""
    import random

    from tunesmith.generate import DECODE_CONTEXT, Answer

    tok = tokenizer if kind == "byte-level" else metaspace_tokenizer()
    text = "the quick  brown fox — naïve café 日本語 🎭🎉 jumps\n\tover  the lazy dog. " * 6
    rng = random.Random(0)
    chars = "abc XYZ  .,!\n\téüß—日本語中文🎭🎉"
    sequences = [tok(t, add_special_tokens=False)["input_ids"]
                 for t in [text, *("".join(rng.choices(chars, k=300)) for _ in range(3))]]
    if kind == "byte-level":
        sequences += [[rng.randrange(len(tok)) for _ in range(200)] for _ in range(3)]
    decoded = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    for ids in sequences:
        answer = Answer(tok, 1, [], len(ids))
        streamed = "".join(answer.add(None, t).text for t in ids)
        assert streamed == decode(ids, skip_special_tokens=True)
    assert len(sequences[0]) > 150 and any("\ufffd" in decode([t]) for t in sequences[0])  # split characters
    longest = 9 * DECODE_CONTEXT + 4  # the widest window (a few tokens more where boundaries are sparse)
    whole = [n for n in decoded if n > longest]
    assert len(whole) < len(decoded) // 50, (len(whole), len(decoded), sorted(whole)[-20:])
