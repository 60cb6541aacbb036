"""--format ollama: the GGUF plus a Modelfile that parses as Ollama's format and renders the tokenizer's chat."""

import json
import re
import shutil

import gguf
import pytest

from tunesmith.cli import main
from tunesmith.errors import TunesmithError
from tunesmith.export import ollama as O

# Ollama's documented Modelfile directives (docs/modelfile.md); anything else is an error there.
DIRECTIVES = {"FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE"}
PARAMETERS = {"mirostat", "mirostat_eta", "mirostat_tau", "num_ctx", "repeat_last_n", "repeat_penalty",
              "temperature", "seed", "stop", "num_predict", "top_k", "top_p", "min_p"}
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(directive, argument) pairs, as Ollama's parser reads them: a directive word, then a value that is bare,
    "quoted" or \"\"\"multi-line\"\"\"; # starts a comment line. Unknown directives raise."""
    out, rest = [], text
    while rest:
        rest = rest.lstrip()
        if not rest:
            break
        if rest.startswith("#"):
            rest = rest.partition("\n")[2]
            continue
        word, _, rest = rest.partition(" ")
        if word.upper() not in DIRECTIVES:
            raise ValueError(f"unknown Modelfile directive {word!r}")
        rest = rest.lstrip(" ")
        if rest.startswith('"""'):
            value, sep, rest = rest[3:].partition('"""')
            assert sep, "unterminated triple quote"
        else:
            value, _, rest = rest.partition("\n")
        out.append((word.upper(), value))
    return out


def render_go(template: str, messages: list[dict]) -> str:
    """Ollama's Go-template subset the ChatML TEMPLATE uses: {{- range .Messages }} ... {{ end }}, .Role, .Content."""
    m = re.fullmatch(r"\{\{-? range \.Messages \}\}(.*)\{\{ end \}\}(.*)", template, re.S)
    assert m, template
    body, tail = m[1], m[2]
    assert set(re.findall(r"\{\{.*?\}\}", body)) <= {"{{ .Role }}", "{{ .Content }}"} and "{{" not in tail
    return "".join(body.replace("{{ .Role }}", x["role"]).replace("{{ .Content }}", x["content"]) for x in messages) + tail


def _ollama_messages(system, messages):
    """Ollama's chat: the Modelfile's SYSTEM goes first when the conversation has no system message."""
    return messages if messages[0]["role"] == "system" or not system else [{"role": "system", "content": system},
                                                                           *messages]


def _folder(tmp_path, tiny_dir, template):
    src = tmp_path / "model"
    shutil.copytree(tiny_dir, src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.jinja").unlink(missing_ok=True)
    return src


CONVERSATIONS = [
    [{"role": "user", "content": "Speak, ROMEO."}],
    [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Who goes there?"},
     {"role": "assistant", "content": "A friend."}, {"role": "user", "content": "Say more.\nTwo lines."}],
]


@pytest.mark.parametrize("template", ["tiny", "smollm2"])
def test_modelfile_parses_names_the_gguf_and_renders_the_tokenizer_s_chat(template, tiny_dir, tokenizer, tmp_path,
                                                                          capsys):
    from tunesmith.models import load_tokenizer

    src = tiny_dir if template == "tiny" else _folder(tmp_path, tiny_dir, SMOLLM2_TEMPLATE)
    out = tmp_path / "ship" / "my-model"
    assert main(["export", "--model", str(src), "--format", "ollama", "--quant", "q8_0", "--calibration-blocks", "0",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"ollama create my-model -f {out / 'Modelfile'}" in printed
    pairs = parse_modelfile((out / "Modelfile").read_text())
    kinds = [k for k, _ in pairs]
    assert kinds.count("FROM") == 1 and kinds.count("TEMPLATE") == 1
    frm = dict(pairs)["FROM"]
    assert frm == "./model-q8_0.gguf" and (out / frm).is_file()
    assert gguf.GGUFReader(out / frm).fields["general.architecture"].contents() == "llama"
    params = [v.split(" ", 1) for k, v in pairs if k == "PARAMETER"]
    assert {p for p, _ in params} <= PARAMETERS
    assert ["stop", '"<|im_end|>"'] in params and ["num_ctx", "512"] in params and ["temperature", "0"] in params
    system = dict(pairs).get("SYSTEM")
    if template == "smollm2":
        assert system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    else:
        assert system is None
    chat = load_tokenizer(str(src))
    for messages in CONVERSATIONS:  # what `tunesmith generate --chat` feeds the model
        want = chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_go(dict(pairs)["TEMPLATE"], _ollama_messages(system, messages)) == want


def test_a_template_that_is_not_chatml_is_left_to_ollama(tiny_dir, tmp_path):
    gemma = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
             "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
             "{% endif %}")
    out = O.export(_folder(tmp_path, tiny_dir, gemma), tmp_path / "o", "f16", 32, 256)
    kinds = [k for k, _ in parse_modelfile((out / "Modelfile").read_text())]
    assert "TEMPLATE" not in kinds and "FROM" in kinds  # Ollama takes tokenizer.chat_template from the GGUF


def test_a_file_name_as_output_is_refused(tiny_dir, tmp_path):
    with pytest.raises(TunesmithError, match="writes a folder"):
        O.export(tiny_dir, tmp_path / "m.gguf", "f16", 32, 256)


# ------------------------------------------------------------------------ the Modelfile's system prompt (the CLI)


def _system_of(folder):
    return dict(parse_modelfile((folder / "Modelfile").read_text())).get("SYSTEM")


def test_system_prompt_is_the_training_data_s_shared_one_or_system_flag(tmp_path_factory, tiny_dir, tmp_path):
    """Every chat record of the run opens with the same system prompt: the Modelfile's SYSTEM is that one; --system
    replaces it; with --format gguf, --system is one line and exit 2."""
    from .cli_process import run_cli
    from .ship_fixtures import SYSTEM, chat_run

    run = chat_run(tmp_path_factory.mktemp("runs") / "ahab", tiny_dir, [SYSTEM] * 6)
    done = run_cli("export", "--adapter", run, "--format", "ollama", "--quant", "f16", "--output", tmp_path / "a")
    assert done.returncode == 0, done.stderr
    assert _system_of(tmp_path / "a") == SYSTEM
    done = run_cli("export", "--adapter", run, "--format", "ollama", "--quant", "f16", "--system", "Be terse.",
                   "--output", tmp_path / "b")
    assert done.returncode == 0, done.stderr
    assert _system_of(tmp_path / "b") == "Be terse."
    done = run_cli("export", "--adapter", run, "--format", "gguf", "--system", "Be terse.", "--output", tmp_path / "c")
    assert done.returncode == 2 and "--system" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_records_without_one_shared_system_prompt_keep_the_template_s_own(tmp_path_factory, tiny_dir, tmp_path):
    """Some records without a system prompt (or with another): the chat template's own default is SYSTEM."""
    from .cli_process import run_cli
    from .ship_fixtures import SYSTEM, chat_run

    base = _folder(tmp_path, tiny_dir, SMOLLM2_TEMPLATE)  # tiny_dir's weights, SmolLM2's template and default
    run = chat_run(tmp_path_factory.mktemp("runs") / "mixed", tiny_dir, [SYSTEM, None, SYSTEM, "Be brief."])
    done = run_cli("export", "--model", base, "--adapter", run, "--format", "ollama", "--quant", "f16", "--output",
                   tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert _system_of(tmp_path / "out") == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
