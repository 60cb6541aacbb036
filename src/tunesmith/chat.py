"""`tunesmith chat`: a conversation in the terminal. Each line you type is a user turn; the answer streams as it is
generated (the one decode loop, through the model's chat template) and joins the history. /reset forgets the
history, /quit (or Ctrl-D) leaves; Ctrl-C during an answer stops that answer.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tunesmith.config import ChatConfig
from tunesmith.errors import TunesmithError
from tunesmith.generate import encode_messages, stream_tokens
from tunesmith.models import context_length

HELP = "/reset forgets the conversation, /quit or Ctrl-D leaves, Ctrl-C stops an answer"


def chat(cfg: ChatConfig, model=None, tokenizer=None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> list[dict]:
    """Talk until /quit or the end of `stdin`; return the conversation as it stood at the end. `model` and
    `tokenizer` skip loading (tests pass small ones)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if model is None:
        from tunesmith.device import resolve_device, resolve_precision, weight_dtype
        from tunesmith.lora import load_with_adapter

        device = resolve_device(cfg.device)
        model, tokenizer, _ = load_with_adapter(cfg.model, cfg.adapter, device,
                                                weight_dtype(device, resolve_precision(device, cfg.precision)),
                                                cfg.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise TunesmithError("chat needs a model with a chat template; this one has none (tunesmith generate "
                             "continues plain text)")
    context = context_length(model, tokenizer)
    start = [{"role": "system", "content": cfg.system}] if cfg.system is not None else []
    history = list(start)
    interactive = stdin.isatty()
    _say(stdout, f"[{HELP}]\n")
    turn = 0
    while True:
        line = _read(stdin, stdout, interactive)
        if line is None:  # end of input (Ctrl-D)
            return history
        text = line.rstrip("\n")
        if text.strip() == "/quit":
            return history
        if text.strip() == "/reset":
            history = list(start)
            _say(stdout, "[conversation reset]\n")
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = _fit(tokenizer, history, start, context - cfg.max_tokens, stdout)
        if ids is None:
            history.pop()
            continue
        answer = []
        try:
            for r in stream_tokens(model, tokenizer, ids, cfg.max_tokens, cfg.temperature, cfg.top_p,
                                   (cfg.seed + turn) % 2**32):
                answer.append(r.text)
                _say(stdout, r.text)
        except KeyboardInterrupt:
            _say(stdout, " [stopped]")
        _say(stdout, "\n")
        history.append({"role": "assistant", "content": "".join(answer)})
        turn += 1


def _fit(tokenizer, history: list[dict], start: list[dict], room: int, stdout: TextIO) -> list[int] | None:
    """The conversation's token ids, leaving `room` for the answer: the oldest turns go first (said so)."""
    ids = encode_messages(tokenizer, history)
    dropped = 0
    while len(ids) > room and len(history) > len(start) + 1:
        del history[len(start) : len(start) + 2]  # the oldest question and its answer
        dropped += 1
        ids = encode_messages(tokenizer, history)
    if dropped:
        _say(stdout, f"[the oldest {dropped} exchange{'s' if dropped > 1 else ''} dropped to fit the context]\n")
    if len(ids) > room:
        _say(stdout, f"[that message is too long: {len(ids)} tokens, and the context leaves {max(room, 0)} with "
                     "room for an answer; shorten it or lower --max-tokens]\n")
        return None
    return ids


def _read(stdin: TextIO, stdout: TextIO, interactive: bool) -> str | None:
    """The next line, or None at the end of input; at a terminal, with a prompt and line editing."""
    if interactive and stdin is sys.stdin and stdout is sys.stdout:
        import readline  # noqa: F401  (input() then edits the line and keeps a history of it)

        try:
            return input("> ")
        except EOFError:
            _say(stdout, "\n")
            return None
    line = stdin.readline()
    return line or None


def _say(stdout: TextIO, text: str) -> None:
    stdout.write(text)
    stdout.flush()
