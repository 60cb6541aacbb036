"""Hostile and dirty data: every malformed file is one specific message with file:line, exit code 2, no traceback;
dirty-but-usable files load, and what was cut or dropped is counted, located and reported."""

import gzip
import io
import json
import zipfile
from pathlib import Path

import pytest

from tunesmith import data as D
from tunesmith.cli import main

OK = '{"text": "to be or not to be"}'


def _lines(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def _zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("train.jsonl", OK)
    return buf.getvalue()


def _chat(*messages) -> str:
    return json.dumps({"messages": list(messages)})


USER, ASSISTANT = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}

# (file name, its bytes, the message: {f} is the file's path; "…" stands for words that vary with the Python
# version). Each is a different way a file can be wrong.
MALFORMED = [
    ("empty.jsonl", b"", "{f}: the file is empty"),
    ("blank-lines-only.jsonl", b"\n  \n\r\n\t\n", "{f}: the file is empty"),
    ("latin1.jsonl", _lines(OK, '{"text": "Rom\xe9o"}').replace(b"\xc3\xa9", b"\xe9"), "{f}:2: not UTF-8 (byte 0xe9)"),
    ("utf16-le.jsonl", (OK + "\n").encode("utf-16"), "{f}: UTF-16 text (it starts with a UTF-16 byte-order mark)"),
    ("utf16-be.jsonl", ("\ufeff" + OK + "\n").encode("utf-16-be"), "{f}: UTF-16 text"),
    ("gzipped.jsonl", gzip.compress(_lines(OK)), "{f}: not text but gzip-compressed: decompress it first"),
    ("zipped.jsonl", _zip(), "{f}: not text but a zip archive: unzip it first"),
    ("sqlite.jsonl", b"SQLite format 3\x00" + bytes(100), "{f}: not text but an SQLite database"),
    ("nul-byte.jsonl", _lines(OK, OK, '{"text": "a\x00b"}'), "{f}:3: NUL byte: this looks like a binary file"),
    ("unterminated.jsonl", _lines(OK, '{"text": "unterminated'), "{f}:2: bad JSON (Unterminated string starting at"),
    ("trailing-comma.jsonl", _lines('{"text": "a",}'), "{f}:1: bad JSON (…); remove the trailing comma"),
    ("single-quotes.jsonl", _lines("{'text': 'python repr'}"), "{f}:1: bad JSON (Expecting property name enclosed in double quotes"),
    ("two-per-line.jsonl", _lines(OK + " " + OK), "{f}:1: bad JSON (Extra data at column 32); put one JSON object per line"),
    ("json-array-document.jsonl", _lines("[", "  " + OK, "]"), "{f}:1: bad JSON (Expecting value at column 2); the file looks like one JSON document"),
    ("pretty-printed.jsonl", _lines("{", '  "text": "a"', "}"), "{f}:1: bad JSON (Expecting property name enclosed in double quotes at column 2); the file looks like one JSON document"),
    ("array-line.jsonl", _lines(OK, "[1, 2]"), "{f}:2: each line must be a JSON object, got an array"),
    ("string-line.jsonl", _lines('"just a string"'), "{f}:1: each line must be a JSON object, got a string"),
    ("number-line.jsonl", _lines(OK, OK, "42"), "{f}:3: each line must be a JSON object, got a number"),
    ("null-line.jsonl", _lines("null"), "{f}:1: each line must be a JSON object, got null"),
    ("bool-line.jsonl", _lines("true"), "{f}:1: each line must be a JSON object, got true/false"),
    ("nested-too-deep.jsonl", _lines("[" * 100_000 + "]" * 100_000), "{f}:1: JSON nested too deeply to be a record"),
    ("no-known-keys.jsonl", _lines('{"body": "x", "id": 1}'), "{f}:1: record has none of the keys 'text', 'prompt'+'completion', 'messages', 'instruction'+'output' (Alpaca) or 'conversations' (ShareGPT) (it has: body, id)"),
    ("empty-object.jsonl", _lines(OK, "{}"), "{f}:2: record has none of the keys 'text', 'prompt'+'completion', 'messages', 'instruction'+'output' (Alpaca) or 'conversations' (ShareGPT) (it has: nothing)"),
    ("two-formats-in-one.jsonl", _lines('{"text": "a", "messages": []}'), "{f}:1: record has keys of more than one format (text, messages)"),
    ("formats-mixed.jsonl", _lines(OK, '{"prompt": "q", "completion": "a"}'), "{f}:2: record is 'completion' but the file's first is 'text'"),
    ("prompt-only.jsonl", _lines('{"prompt": "a", "completion": "b"}', '{"prompt": "a", "completion": "b"}', '{"prompt": "only"}'), "{f}:3: missing key 'completion'"),
    ("completion-only.jsonl", _lines('{"completion": "b"}'), "{f}:1: missing key 'prompt'"),
    ("text-number.jsonl", _lines(OK, '{"text": 42}'), "{f}:2: 'text' must be a str, got int"),
    ("text-null.jsonl", _lines('{"text": null}'), "{f}:1: 'text' must be a str, got null"),
    ("text-nan.jsonl", _lines('{"text": NaN}'), "{f}:1: 'text' must be a str, got float"),
    ("prompt-list.jsonl", _lines('{"prompt": ["a"], "completion": "b"}'), "{f}:1: 'prompt' must be a str, got list"),
    ("completion-object.jsonl", _lines('{"prompt": "a", "completion": {"x": 1}}'), "{f}:1: 'completion' must be a str, got dict"),
    ("messages-string.jsonl", _lines('{"messages": "hi"}'), "{f}:1: 'messages' must be a list, got str"),
    ("messages-empty.jsonl", _lines(_chat(USER, ASSISTANT), '{"messages": []}'), "{f}:2: 'messages' is empty"),
    ("message-no-content.jsonl", _lines(_chat({"role": "user"})), "{f}:1: messages[0] must be an object with string 'role' and 'content'"),
    ("message-content-parts.jsonl", _lines(_chat(USER, {"role": "assistant", "content": [{"type": "text", "text": "x"}]})), "{f}:1: messages[1] must be an object with string 'role' and 'content'"),
    ("message-not-object.jsonl", _lines(_chat(USER, ASSISTANT), '{"messages": ["hello"]}'), "{f}:2: messages[0] must be an object"),
    ("role-number.jsonl", _lines(_chat({"role": 1, "content": "x"})), "{f}:1: messages[0] must be an object with string 'role'"),
    ("lone-surrogate.jsonl", _lines(OK, '{"text": "bad \\ud800 escape"}'), "{f}:2: 'text' holds an invalid Unicode escape (lone surrogate \\ud800)"),
    ("lone-surrogate-chat.jsonl", _lines(_chat(USER).replace(']}', ', {"role": "assistant", "content": "\\udfff"}]}')), "{f}:1: messages[1].content holds an invalid Unicode escape (lone surrogate \\udfff)"),
    ("sharegpt-unknown-role.jsonl", _lines(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "wizard", "value": "x"}]})), "{f}:1: conversations[1].from is 'wizard', a role tunesmith does not know (it learns the assistant's turns and reads the rest as prompt): use user or human; assistant, gpt or bot; system; tool"),
    ("message-unknown-role.jsonl", _lines(_chat(USER, ASSISTANT), _chat(USER, {"role": "narrator", "content": "x"})), "{f}:2: messages[1].role is 'narrator', a role tunesmith does not know"),
    ("sharegpt-role-content.jsonl", _lines(json.dumps({"conversations": [USER, ASSISTANT]})), "{f}:1: conversations[0] must be an object with string 'from' and 'value'; turns with 'role' and 'content' go under 'messages'"),
    ("messages-from-value.jsonl", _lines(_chat({"from": "human", "value": "hi"})), "{f}:1: messages[0] must be an object with string 'role' and 'content'; turns with 'from' and 'value' go under 'conversations'"),
    ("sharegpt-empty.jsonl", _lines('{"conversations": []}'), "{f}:1: 'conversations' is empty"),
    ("sharegpt-no-assistant.jsonl", _lines(json.dumps({"conversations": [{"from": "human", "value": "hi"}]})), "{f}:1: no assistant turn; no record of sharegpt-no-assistant.jsonl has a token to learn"),
    ("alpaca-no-output.jsonl", _lines('{"instruction": "say hi", "input": ""}'), "{f}:1: missing key 'output'"),
    ("alpaca-output-number.jsonl", _lines('{"instruction": "add", "output": 2}'), "{f}:1: 'output' must be a str, got int"),
    ("alpaca-and-text.jsonl", _lines('{"instruction": "a", "output": "b", "text": "c"}'), "{f}:1: record has keys of more than one format (text, instruction, output)"),
    ("completion-empty.jsonl", _lines('{"prompt": "", "completion": ""}'), "{f}:1: empty 'completion'; no record of completion-empty.jsonl has a token to learn"),
    ("table.csv", b"prompt,completion\nhi,hello\n", "{f}: tunesmith does not read .csv files; it reads plain text (.txt, .md or no extension), JSON Lines (.jsonl: text, prompt/completion, messages, Alpaca or ShareGPT records) or a folder with train.jsonl: convert it to JSON Lines, e.g. with pandas: pd.read_csv('table.csv').to_json('table.jsonl', orient='records', lines=True)"),
    ("table.tsv", b"prompt\tcompletion\nhi\thello\n", "{f}: tunesmith does not read .tsv files"),
    ("table.parquet", b"PAR1" + bytes(20), "{f}: tunesmith does not read .parquet files"),
    ("notes.dat", b"plain words\n", "{f}: tunesmith does not read .dat files; it reads plain text (.txt, .md or no extension), JSON Lines (.jsonl: text, prompt/completion, messages, Alpaca or ShareGPT records) or a folder with train.jsonl: rename it .txt if it is plain text, or convert it to JSON Lines"),
    ("huge-line.jsonl", _lines('{"text": "' + "x" * (D.MAX_RECORD_CHARS + 1) + '"}'), "{f}:1: every line is longer than 8 MiB, too long to be one record"),
    ("no-assistant-turn.jsonl", _lines(_chat(USER), _chat(USER)), "{f}:1: no assistant turn; no record of no-assistant-turn.jsonl has a token to learn: the loss is taken on 'text', on the completion ('completion', Alpaca's 'output') or on assistant turns only"),
    ("empty-texts.jsonl", _lines('{"text": ""}', '{"text": ""}'), "{f}:1: empty 'text'; no record of empty-texts.jsonl has a token to learn"),
    ("completion-past-cut.jsonl", _lines(json.dumps({"prompt": "word " * 50, "completion": "end"})), "{f}: zero trainable tokens after truncation to --seq-len 32: every record's supervised part (completion / assistant turns) falls past the cut (first: {f}:1)"),
    ("bom-then-bad-line.jsonl", b"\xef\xbb\xbf" + _lines(OK, '{"text": 7}'), "{f}:2: 'text' must be a str, got int"),
    ("crlf-then-bad-line.jsonl", _lines(OK, OK, '{"text": 7}').replace(b"\n", b"\r\n"), "{f}:3: 'text' must be a str, got int"),
    ("u2028-then-bad-line.jsonl", _lines('{"text": "a\u2028b\u0085c"}', '{"text": 7}'), "{f}:2: 'text' must be a str, got int"),
    ("records.json", b'[{"text": "a"}]', "{f}: a .json file; tunesmith reads JSON Lines (.jsonl, one object per line)"),
    ("too-short.txt", b"hi", "{f}: only 2 tokens, too few for one training block of --seq-len 32"),
]


def _folders(tmp_path: Path) -> list[tuple[Path, str]]:
    """Malformed folders: no train.jsonl, and a bad valid.jsonl (named, with its line)."""
    (tmp_path / "no-train").mkdir()
    (tmp_path / "no-train" / "valid.jsonl").write_bytes(_lines(OK))
    bad_valid = tmp_path / "bad-valid"
    bad_valid.mkdir()
    (bad_valid / "train.jsonl").write_bytes(_lines(OK, OK))
    (bad_valid / "valid.jsonl").write_bytes(_lines(OK, "{oops"))
    return [(tmp_path / "no-train", "{f}: a data folder needs train.jsonl"),
            (bad_valid, f"{bad_valid / 'valid.jsonl'}:2: bad JSON (Expecting property name")]


def test_there_are_at_least_30_distinct_malformed_fixtures():
    names = [name for name, _, _ in MALFORMED]
    assert len(set(names)) == len(names) >= 30
    assert len({raw for _, raw, _ in MALFORMED}) == len(MALFORMED)  # no two fixtures are the same bytes


def test_every_malformed_file_gives_its_message_with_file_and_line_and_exit_code_2(tmp_path, tiny_dir, capsys):
    cases = [(tmp_path / "missing.jsonl", "data not found: {f}")]
    for name, raw, message in MALFORMED:
        (tmp_path / name).write_bytes(raw)
        cases.append((tmp_path / name, message))
    cases += _folders(tmp_path)
    failures = []
    for path, message in cases:
        code = main(["train", "--model", str(tiny_dir), "--data", str(path), "--output", str(tmp_path / "run"),
                     "--device", "cpu", "--seq-len", "32", "--max-steps", "1"])
        err = capsys.readouterr().err
        expected = f"tunesmith train: error: {message.format(f=path)}"
        head, *rest = expected.split("…")
        ok = code == 2 and err.startswith(head) and all(part in err for part in rest)
        ok = ok and "Traceback" not in err and len(err.strip().splitlines()) == 1
        if not ok:
            failures.append((path.name, code, expected, err))
    assert not failures, "\n".join(map(str, failures))


# ---- dirty but usable: cleaned, counted, located, reported --------------------------------------------------


@pytest.fixture
def dirty_folder(tmp_path) -> Path:
    folder = tmp_path / "dirty"
    folder.mkdir()
    huge = '{"text": "' + "x" * (D.MAX_RECORD_CHARS + 1) + '"}'
    train = [
        '{"text": "ROMEO: But soft, what light"}',  # 1 (the file starts with a BOM)
        "",  # 2 blank
        '{"text": "' + "to be or not to be " * 20 + '"}',  # 3 longer than --seq-len: truncated
        "   ",  # 4 blank
        "\ufeff" + '{"text": "JULIET: a BOM where two files were joined"}',  # 5
        '{"text": ""}',  # 6 nothing to learn: dropped
        '{"text": "one\u2028record\u0085here"}',  # 7 one record, not three (splitlines() would cut it)
        huge,  # 8 dropped unparsed
        '{"text": "First Citizen: hear me speak"}',  # 9
    ]
    (folder / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(train).encode() + b"\r\n")
    valid = [json.dumps({"prompt": "word " * 50, "completion": "end"}),  # 1 supervised part past the cut
             json.dumps({"prompt": "Q: ", "completion": "A"})]
    (folder / "valid.jsonl").write_text("\n".join(valid) + "\n", encoding="utf-8")
    return folder


def test_dirty_data_loads_with_every_cut_and_drop_counted_and_located(dirty_folder, tokenizer):
    d = D.load_data(str(dirty_folder), tokenizer, seq_len=32)
    train, valid = dirty_folder / "train.jsonl", dirty_folder / "valid.jsonl"
    assert len(d.train) == 5 and len(d.valid) == 1
    assert d.stats == {"records": 7, "truncated": 1, "dropped_past_seq_len": 0, "no_supervised_tokens": 1,
                       "dropped_too_long_line": 1, "valid_records": 2, "valid_truncated": 0,
                       "valid_dropped_past_seq_len": 1, "valid_no_supervised_tokens": 0,
                       "valid_dropped_too_long_line": 0}
    assert d.where == {"truncated": [f"{train}:3"], "no_supervised_tokens": [f"{train}:6: empty 'text'"],
                       "dropped_too_long_line": [f"{train}:8"], "dropped_past_seq_len": [f"{valid}:1"]}
    texts = [tokenizer.decode(ids) for ids, _ in d.train]
    assert texts[0] == "ROMEO: But soft, what light<|im_end|>"  # the BOM is gone
    assert texts[2] == "JULIET: a BOM where two files were joined<|im_end|>"
    assert texts[3] == "one\u2028record\u0085here<|im_end|>"
    assert max(len(ids) for ids, _ in d.train) == 32


def test_the_train_output_reports_the_counts(dirty_folder, tiny_dir, tmp_path, capsys):
    code = main(["train", "--model", str(tiny_dir), "--data", str(dirty_folder), "--output", str(tmp_path / "run"),
                 "--device", "cpu", "--seq-len", "32", "--max-steps", "1", "--eval-every", "0"])
    out = capsys.readouterr().out
    train, valid = dirty_folder / "train.jsonl", dirty_folder / "valid.jsonl"
    assert code == 0
    assert (f"data {dirty_folder}: 9 records -> 5 training, 1 held out; 1 truncated to --seq-len ({train}:3); "
            f"1 dropped: every supervised token past --seq-len ({valid}:1); 1 dropped: no supervised tokens "
            f"({train}:6: empty 'text'); 1 dropped: line over 8 MiB ({train}:8)") in out
