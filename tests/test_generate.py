import pytest
import torch

from tunesmith.errors import TunesmithError
from tunesmith.generate import encode_prompt, generate, sample_next, stream_generate


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


def test_bad_arguments(tiny_model, tokenizer):
    with pytest.raises(TunesmithError, match="--top-p"):
        list(stream_generate(tiny_model, tokenizer, "a", top_p=0.0))
    with pytest.raises(TunesmithError, match="--max-tokens"):
        list(stream_generate(tiny_model, tokenizer, "a", max_tokens=0))
