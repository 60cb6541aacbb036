"""`tunesmith chat`: lines in, streamed answers out, the history kept until /reset; fed through injected streams."""

from __future__ import annotations

import io

from tunesmith.chat import HELP, chat
from tunesmith.cli import main
from tunesmith.config import ChatConfig
from tunesmith.generate import encode_messages, generate, stream_tokens


def answer(model, tokenizer, messages, max_tokens, seed=0):
    ids = encode_messages(tokenizer, messages)
    return "".join(r.text for r in stream_tokens(model, tokenizer, ids, max_tokens, seed=seed))


def test_each_answer_sees_the_history_until_reset(tiny_model, tokenizer):
    out = io.StringIO()
    cfg = ChatConfig(max_tokens=8, device="cpu")
    history = chat(cfg, tiny_model, tokenizer, io.StringIO("hello\nand then?\n/reset\nhi again\n/quit\nnever read\n"),
                   out)
    first = generate(tiny_model, tokenizer, "hello", max_tokens=8, chat=True)  # what `generate --chat` says
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "and then?"}]
    second = answer(tiny_model, tokenizer, turns, 8)
    third = generate(tiny_model, tokenizer, "hi again", max_tokens=8, chat=True)
    assert out.getvalue() == f"[{HELP}]\n{first}\n{second}\n[conversation reset]\n{third}\n"
    assert history == [{"role": "user", "content": "hi again"}, {"role": "assistant", "content": third}]


def test_the_system_message_stays_through_reset_and_end_of_input_leaves(tiny_model, tokenizer):
    cfg = ChatConfig(max_tokens=6, device="cpu", system="Be brief.")
    out = io.StringIO()
    history = chat(cfg, tiny_model, tokenizer, io.StringIO("one\n/reset\n\ntwo"), out)  # no /quit: EOF ends it
    two = generate(tiny_model, tokenizer, "two", max_tokens=6, chat=True, system="Be brief.")
    assert history == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "two"},
                       {"role": "assistant", "content": two}]
    assert out.getvalue().endswith(f"[conversation reset]\n{two}\n")


def test_old_turns_give_way_when_the_context_fills(tiny_model, tokenizer):
    tiny_model.config.max_position_embeddings = 60  # room for two short exchanges and an answer of 8
    out = io.StringIO()
    lines = "".join(f"question number {i}\n" for i in range(4))
    history = chat(ChatConfig(max_tokens=8, device="cpu"), tiny_model, tokenizer, io.StringIO(lines), out)
    assert "dropped to fit the context" in out.getvalue()
    assert history[-2]["content"] == "question number 3" and history[0]["content"] != "question number 0"
    assert len(encode_messages(tokenizer, history[:-1])) <= 60 - 8

    out = io.StringIO()
    chat(ChatConfig(max_tokens=8, device="cpu"), tiny_model, tokenizer, io.StringIO("word " * 80 + "\nhi\n"), out)
    assert "that message is too long" in out.getvalue() and out.getvalue().count("\n") == 3  # and "hi" answered


def test_the_chat_verb_loads_the_model_and_talks(tiny_dir, tokenizer, monkeypatch, capsys):
    from tunesmith.models import load_model

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens", "5"]) == 0
    model, _ = load_model(str(tiny_dir), "cpu")
    assert capsys.readouterr().out == f"[{HELP}]\n{generate(model, tokenizer, 'hello', max_tokens=5, chat=True)}\n"
