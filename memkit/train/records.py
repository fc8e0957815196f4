"""Reading training data into checked records of one format.

Files: `.jsonl` (one JSON object a line), `.json` (an array of objects, or JSON lines),
`.txt`/`.md` (documents separated by blank lines), `.csv` and `.parquet` (read with the
`datasets` library), and `datasets` folders (`Dataset.save_to_disk`, a DatasetDict's 'train'
split). Every record of a file has one of these formats (the first record decides):

    text               {"text": "..."}
    prompt_completion  {"prompt": "...", "completion": "..."}        loss on the completion
    alpaca             {"instruction": "...", "input": "...", "output": "..."}   loss on output
    chat               {"messages": [{"role": "user", "content": "..."}, ...]}   loss on
                       {"conversations": [{"from": "human", "value": "..."}, ...]}  assistant turns
    seq2seq            {"source": "...", "target": "..."}   encoder-decoders: loss on the target
    classification     {"text": "...", "label": 2}          --task seq-cls: one class id per text
    token_classification {"tokens": ["EU", "rejects"], "labels": [3, 0]}   --task token-cls: a class
                       id per word ("ner_tags" is read as "labels", the conll2003 layout)

A classification record is also a text record: a causal-LM run trains on its text (data.py).

`conversations` is the ShareGPT layout (FastChat: fastchat/data; from = human | gpt | system);
it is read into `messages` with roles user / assistant / system.
"""
from __future__ import annotations

import json
from pathlib import Path

from memkit.errors import MemkitError

SYNTHETIC = "synthetic"
KINDS = ("text", "prompt_completion", "alpaca", "chat", "seq2seq", "classification", "token_classification")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
"""ShareGPT 'from' values (FastChat's conversation files) -> chat roles."""
_EXPECTED = ("expected 'text', or 'prompt' and 'completion', or 'instruction' and 'output' (alpaca), "
             "or 'messages' / 'conversations' (chat), or 'source' and 'target' (seq2seq), or 'text' and 'label' "
             "(seq-cls), or 'tokens' and 'labels' (token-cls)")


def read_records(source: str, *, flag: str = "--data") -> tuple[str, list[dict]]:
    """(kind, records) from a file or datasets folder; every record checked and normalised.

    Each record carries `_where` ("line 3", "row 7") for error messages."""
    what = f"{flag} {source}"
    path = Path(source).expanduser()
    if not path.exists():
        raise MemkitError(f"{what}: no such file or folder; pass a .jsonl/.json/.csv/.parquet/.txt file, "
                          f"a datasets folder (save_to_disk) or '{SYNTHETIC}'")
    if path.is_dir():
        return _checked(_read_datasets_folder(path, what), what)
    from memkit.fileio import check_file

    check_file(path, what=what)  # a FIFO or device is refused before it is opened (it would block)
    if path.stat().st_size == 0:
        raise MemkitError(f"{what} is empty; it needs at least one record")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _checked(_read_json_lines(path, what), what)
    if suffix == ".json":
        return _checked(_read_json(path, what), what)
    if suffix in (".csv", ".parquet"):
        return _checked(_read_with_datasets(path, suffix[1:], what), what)
    if suffix in (".txt", ".text", ".md"):
        text = path.read_text(encoding="utf-8-sig", errors="strict")  # -sig: a BOM (Windows editors) dropped
        docs = [doc.strip("\n") for doc in text.split("\n\n")]
        docs = [doc for doc in docs if doc.strip()]
        if not docs:
            raise MemkitError(f"{what} has no text (only whitespace)")
        return "text", [{"text": doc, "_where": f"document {i}"} for i, doc in enumerate(docs)]
    raise MemkitError(f"{what}: unknown file type {suffix!r}; use .jsonl, .json, .csv, .parquet, .txt "
                      "or a datasets folder")


def _checked(rows: list[tuple[str, object]], what: str) -> tuple[str, list[dict]]:
    if not rows:
        raise MemkitError(f"{what} is empty (only blank lines); it needs at least one record")
    kind, records = None, []
    for where, row in rows:
        record_kind, record = record_of(row, f"{what}: {where}")
        if kind is None:
            kind = record_kind
        elif record_kind != kind:
            raise MemkitError(f"{what}: {where} is a {record_kind} record but earlier "
                              f"{where.split()[0]}s are {kind} records; use one format per file")
        record["_where"] = where
        records.append(record)
    return kind, records


def _read_json_lines(path: Path, what: str) -> list[tuple[str, object]]:
    rows = []
    with path.open(encoding="utf-8-sig") as handle:  # -sig: a BOM dropped; CRLF read as newlines
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {line_no}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise MemkitError(f"{what}: line {line_no} is not JSON ({exc.msg}); "
                                  "write one JSON object per line") from None
    return rows


def _read_json(path: Path, what: str) -> list[tuple[str, object]]:
    """A JSON array of records (the alpaca_data.json layout), else JSON lines."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return _read_json_lines(path, what)
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise MemkitError(f"{what} holds a JSON {type(doc).__name__}; write an array of objects")
    return [(f"item {i}", row) for i, row in enumerate(doc)]


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise MemkitError(f"{what} needs the `datasets` package; pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # its errors come as ours, one line
    return datasets


def _reason(exc: BaseException) -> str:
    """The first line of the innermost cause (datasets wraps pandas/pyarrow errors)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _read_with_datasets(path: Path, builder: str, what: str) -> list[tuple[str, object]]:
    datasets = _datasets(what)
    try:
        data = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # pyarrow / csv parser errors: report them as bad input
        raise MemkitError(f"{what}: cannot read it as {builder} ({_reason(exc)})") from None
    return [(f"row {i}", row) for i, row in enumerate(data.to_list())]


DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `datasets`' save_to_disk writes; a folder without any is not a datasets folder."""


def _read_datasets_folder(path: Path, what: str) -> list[tuple[str, object]]:
    markers = DATASETS_MARKERS
    if not any((path / name).exists() for name in markers):
        raise MemkitError(f"{what} is a folder but not a datasets folder (no "
                          f"{' / '.join(markers)}); write it with Dataset.save_to_disk or pass a file")
    datasets = _datasets(what)
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged state.json / dataset_info.json / arrow file
        raise MemkitError(f"{what}: cannot read it as a datasets folder ({_reason(exc)}); write it again with "
                          "save_to_disk") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise MemkitError(f"{what} has splits {sorted(data)} but no 'train'; save the "
                              "training split as 'train'")
        data = data["train"]
    if data.num_rows == 0:
        raise MemkitError(f"{what} is empty; it needs at least one row")
    return [(f"row {i}", row) for i, row in enumerate(data.to_list())]


# ---- one record ----------------------------------------------------------------------------------

def record_of(row, where: str) -> tuple[str, dict]:
    """(kind, normalised record) of one row, or MemkitError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise MemkitError(f"{where} is a {type(row).__name__}, not an object; {_EXPECTED}")
    if "text" in row and "label" in row:
        return "classification", {"text": _string(row, "text", where), "label": _class_id(row["label"], "label", where)}
    if "text" in row:
        return "text", {"text": _string(row, "text", where)}
    if "source" in row and "target" in row:
        source, target = _string(row, "source", where), _string(row, "target", where)
        if not target:
            raise MemkitError(f"{where}: 'target' is empty; the loss is taken on it")
        return "seq2seq", {"source": source, "target": target}
    if "tokens" in row and ("labels" in row or "ner_tags" in row):
        return "token_classification", _token_labels(row, where)
    if "prompt" in row and "completion" in row:
        prompt, completion = _string(row, "prompt", where), _string(row, "completion", where)
        if not completion:
            raise MemkitError(f"{where}: 'completion' is empty; the loss is taken on it")
        return "prompt_completion", {"prompt": prompt, "completion": completion}
    if "instruction" in row and "output" in row:
        extra = row.get("input")
        record = {"instruction": _string(row, "instruction", where), "output": _string(row, "output", where),
                  "input": "" if extra is None else _string(row, "input", where)}
        if not record["output"]:
            raise MemkitError(f"{where}: 'output' is empty; the loss is taken on it")
        return "alpaca", record
    if "messages" in row or "conversations" in row:
        return "chat", {"messages": _messages(row, where)}
    keys = sorted(k for k in row if not str(k).startswith("_"))
    raise MemkitError(f"{where} has fields {keys}; {_EXPECTED}")


def _class_id(value, key: str, where: str) -> int:
    """A class id: an int (not a bool); its range is checked against --num-labels in data.py."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemkitError(f"{where}: {key!r} is {value!r} ({type(value).__name__}); it must be an integer class id "
                          "0..num_labels-1 (map label names to ids first)")
    return value


def _token_labels(row: dict, where: str) -> dict:
    key = "labels" if "labels" in row else "ner_tags"
    tokens, labels = row["tokens"], row[key]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise MemkitError(f"{where}: 'tokens' must be a non-empty list of non-empty strings (the words)")
    if not isinstance(labels, list) or len(labels) != len(tokens):
        shown = len(labels) if isinstance(labels, list) else type(labels).__name__
        raise MemkitError(f"{where}: {key!r} has {shown} entries for {len(tokens)} tokens; give one class id per word")
    return {"tokens": tokens, "labels": [_class_id(v, f"{key}[{i}]", where) for i, v in enumerate(labels)]}


def _string(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise MemkitError(f"{where}: {key!r} is a {type(value).__name__}; it must be a string")
    return value


def _messages(row: dict, where: str) -> list[dict]:
    sharegpt = "messages" not in row
    key, role_key, content_key = (("conversations", "from", "value") if sharegpt
                                  else ("messages", "role", "content"))
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise MemkitError(f"{where}: {key!r} must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise MemkitError(f"{where}: {key}[{i}] needs {role_key!r} and {content_key!r} fields")
        role, content = turn[role_key], turn[content_key]
        if sharegpt:
            if role not in SHAREGPT_ROLES:
                raise MemkitError(f"{where}: {key}[{i}] has from={role!r}; use one of "
                                  f"{', '.join(SHAREGPT_ROLES)}")
            role = SHAREGPT_ROLES[role]
        if not isinstance(role, str) or not isinstance(content, str):
            raise MemkitError(f"{where}: {key}[{i}]: {role_key!r} and {content_key!r} must be strings")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise MemkitError(f"{where}: no assistant turn; the loss is taken on assistant turns only")
    return out
