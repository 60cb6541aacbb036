"""HF folder -> a folder Ollama imports: the GGUF (gguf.py) and a Modelfile naming it.

    ollama create NAME -f <folder>/Modelfile

The Modelfile uses only Ollama's documented directives: FROM the GGUF beside it, TEMPLATE (the model's chat template
in Ollama's Go-template syntax), SYSTEM (the system prompt a conversation without one gets: --system, else the one
every record of the training data opens with, else the chat template's own default),
PARAMETER stop (the end-of-turn tokens) and PARAMETER temperature / top_p / num_ctx (tunesmith generate's
defaults and the model's context). The template is converted only for the ChatML layout (SmolLM2, Qwen and the
like), checked by rendering probe conversations through the tokenizer's own template; for any other layout the
Modelfile has no TEMPLATE and Ollama reads the chat template from the GGUF itself (it matches known ones by name).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tunesmith.errors import TunesmithError
from tunesmith.export import gguf

MODELFILE = "Modelfile"
CONTEXT_CAP = 8192  # Ollama allocates the KV cache for num_ctx up front; a 128k context would not fit a laptop
# Ollama's Go template for ChatML: each message as <|im_start|>role\ncontent<|im_end|>\n, then the assistant's turn.
CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
PROBE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "?"}]


def check_quant(quant: str, group_size: int | None = gguf.BLOCK) -> str:
    return gguf.check_quant(quant, group_size)


calibrated = gguf.calibrated


def export(
    model_dir: Path,
    output: Path,
    quant: str,
    group_size: int | None,
    max_seq_len: int,
    calibration: Sequence[Sequence[int]] | None = None,
    progress: bool = True,
    name: str | None = None,
    system: str | None = None,
) -> Path:
    """Write the GGUF and a Modelfile into the folder `output`; returns the folder. `system`: the Modelfile's
    SYSTEM prompt ('' for none; None: the chat template's own default, if it has one). The other arguments are
    gguf.export's."""
    out = Path(output)
    if out.suffix:
        raise TunesmithError(f"--format ollama writes a folder (the GGUF and its Modelfile); {out} looks like a file")
    qname = check_quant(quant, group_size)
    modelfile = modelfile_text(Path(model_dir), f"model-{qname}.gguf", system)  # refuse before the minutes of export
    gguf.export(model_dir, out, quant, group_size, max_seq_len, calibration, progress, name)
    (out / MODELFILE).write_text(modelfile, encoding="utf-8")
    return out


def create_command(folder: Path) -> str:
    """The command that imports the export into Ollama, named after its folder."""
    name = re.sub(r"[^a-z0-9._-]+", "-", Path(folder).resolve().name.lower()).strip("-.") or "tunesmith"
    return f"ollama create {name} -f {Path(folder) / MODELFILE}"


def modelfile_text(model_dir: Path, gguf_name: str, system: str | None = None) -> str:
    from tunesmith.config import GenerateConfig
    from tunesmith.models import load_tokenizer

    if system and '"""' in system:  # the Modelfile quotes it in triple quotes, which have no escape
        raise TunesmithError('the system prompt holds """, which a Modelfile cannot quote; pass --system with one '
                             'that does not')
    tokenizer = load_tokenizer(str(model_dir))
    lines = [f"FROM ./{gguf_name}"]
    template, own = chat_template(tokenizer)
    system = own if system is None else system
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    if system:
        lines.append(f'SYSTEM """{system}"""')
    for stop in stop_tokens(tokenizer):
        lines.append(f"PARAMETER stop {json.dumps(stop)}")
    defaults = GenerateConfig()
    lines.append(f"PARAMETER temperature {defaults.temperature:g}")
    lines.append(f"PARAMETER top_p {defaults.top_p:g}")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    context = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if context:
        lines.append(f"PARAMETER num_ctx {min(int(context), CONTEXT_CAP)}")
    return "\n".join(lines) + "\n"


def _render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_chatml(messages: list[dict]) -> str:
    """What Ollama renders from CHATML for `messages` (Ollama puts SYSTEM first when they have no system message)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def chat_template(tokenizer) -> tuple[str | None, str | None]:
    """(Ollama TEMPLATE, default system prompt) for the tokenizer's chat template, or (None, None) when it is not
    ChatML: the conversion must render the probe conversations exactly as the tokenizer does."""
    if not getattr(tokenizer, "chat_template", None):
        return None, None
    try:
        bare = _render(tokenizer, PROBE)
        with_system = _render(tokenizer, [{"role": "system", "content": "Be brief."}, *PROBE])
    except Exception:  # a template that refuses a system message or this turn order: leave it to Ollama
        return None, None
    if with_system != render_chatml([{"role": "system", "content": "Be brief."}, *PROBE]):
        return None, None
    if bare == render_chatml(PROBE):
        return CHATML, None
    m = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", bare, re.S)
    if m and bare == render_chatml([{"role": "system", "content": m[1]}, *PROBE]):
        return CHATML, m[1]  # the template's own default system prompt
    return None, None


def stop_tokens(tokenizer) -> list[str]:
    """The end-of-turn tokens a reply ends with: the tokenizer's EOS, and ChatML's <|im_end|> / Gemma's
    <end_of_turn> / Llama 3's <|eot_id|> when the vocabulary has them."""
    vocab = tokenizer.get_vocab()
    stops = [t for t in (tokenizer.eos_token, "<|im_end|>", "<end_of_turn>", "<|eot_id|>") if t and t in vocab]
    return list(dict.fromkeys(stops))
