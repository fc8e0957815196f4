"""Training data: read, tokenize, pack to --seq-len, and shard across data-parallel ranks.

Sources: a `.jsonl` file (a `text` field, or `prompt` + `completion` with the loss on the
completion only), a `.txt` file (documents separated by blank lines), a local Hugging Face
`datasets` folder (`save_to_disk`), or `synthetic[:N]` (seeded random tokens, for `verify`).

Every rank reads and packs the whole data set the same way, so the sequence at each position
of the run is known everywhere and the order is a pure function of (seed, step): a resumed run
continues at exactly the same sample, and each rank can count the loss tokens of the whole
accumulation window without communicating (see loop.py, loss normalisation).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from memkit.errors import MemkitError

IGNORE_INDEX = -100
"""Label that cross-entropy skips (torch.nn.functional.cross_entropy's default ignore_index)."""
SYNTHETIC = "synthetic"


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedData:
    """Fixed-length training sequences, shape [num_sequences, seq_len] each."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    """Next-token targets are labels[:, 1:]; IGNORE_INDEX where no loss is taken."""
    attention_mask: torch.Tensor
    kind: str
    """'text', 'prompt_completion' or 'synthetic'."""
    source: str
    num_documents: int
    num_dropped_tokens: int = 0
    """Tail tokens of a text stream that did not fill a last sequence."""
    loss_tokens: torch.Tensor = field(init=False)
    """Per sequence: how many positions contribute to the loss (shifted labels != IGNORE_INDEX)."""

    def __post_init__(self):
        object.__setattr__(self, "loss_tokens", (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1))

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def fingerprint(self) -> str:
        """sha256 of the packed tokens and labels: a resumed run checks it saw the same data."""
        digest = hashlib.sha256()
        digest.update(self.input_ids.numpy().tobytes())
        digest.update(self.labels.numpy().tobytes())
        return digest.hexdigest()[:16]

    def batch(self, indices) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return {"input_ids": self.input_ids[index], "labels": self.labels[index],
                "attention_mask": self.attention_mask[index]}


# ---- reading -------------------------------------------------------------------------------

def read_records(source: str) -> tuple[str, list[dict]]:
    """(kind, records) from a .jsonl/.txt file or a datasets folder; every record checked."""
    path = Path(source)
    if not path.exists():
        raise MemkitError(f"--data {source}: no such file or folder; pass a .jsonl, .txt, a datasets "
                          f"folder (save_to_disk) or '{SYNTHETIC}'")
    if path.is_dir():
        return _read_datasets_folder(path)
    if path.stat().st_size == 0:
        raise MemkitError(f"--data {source} is empty; it needs at least one record")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if suffix in (".txt", ".text", ".md"):
        text = path.read_text(encoding="utf-8", errors="strict")
        docs = [doc.strip("\n") for doc in text.split("\n\n")]
        docs = [doc for doc in docs if doc.strip()]
        if not docs:
            raise MemkitError(f"--data {source} has no text (only whitespace)")
        return "text", [{"text": doc} for doc in docs]
    raise MemkitError(f"--data {source}: unknown file type {suffix!r}; use .jsonl (text or "
                      "prompt/completion), .txt or a datasets folder")


def _read_jsonl(path: Path) -> tuple[str, list[dict]]:
    records: list[dict] = []
    kind = None
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MemkitError(f"--data {path}: line {line_no} is not JSON ({exc.msg}); "
                                  "write one JSON object per line") from None
            record_kind = _record_kind(record, f"{path}: line {line_no}")
            if kind is None:
                kind = record_kind
            elif record_kind != kind:
                raise MemkitError(f"--data {path}: line {line_no} is a {record_kind} record but earlier "
                                  f"lines are {kind} records; use one format per file")
            record["_where"] = f"line {line_no}"
            records.append(record)
    if not records:
        raise MemkitError(f"--data {path} is empty (only blank lines); it needs at least one record")
    return kind, records


def _record_kind(record, where: str) -> str:
    if not isinstance(record, dict):
        raise MemkitError(f"--data {where} is a {type(record).__name__}, not an object with a 'text' "
                          "field or 'prompt' and 'completion' fields")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise MemkitError(f"--data {where}: 'text' is a {type(record['text']).__name__}; it must "
                              "be a string")
        return "text"
    if "prompt" in record and "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                raise MemkitError(f"--data {where}: {key!r} is a {type(record[key]).__name__}; it must "
                                  "be a string")
        if not record["completion"]:
            raise MemkitError(f"--data {where}: 'completion' is empty; the loss is taken on it")
        return "prompt_completion"
    keys = sorted(k for k in record if not k.startswith("_"))
    raise MemkitError(f"--data {where} has fields {keys}; expected 'text', or 'prompt' and "
                      "'completion'")


DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `datasets`' save_to_disk writes; a folder without any is not a datasets folder."""


def _read_datasets_folder(path: Path) -> tuple[str, list[dict]]:
    markers = DATASETS_MARKERS
    if not any((path / name).exists() for name in markers):
        raise MemkitError(f"--data {path} is a folder but not a datasets folder (no "
                          f"{' / '.join(markers)}); write it with Dataset.save_to_disk or pass a file")
    try:
        import datasets
    except ImportError:
        raise MemkitError(f"--data {path} is a datasets folder but the `datasets` package is not "
                          "installed; pip install datasets") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise MemkitError(f"--data {path} has splits {sorted(data)} but no 'train'; save the "
                              "training split as 'train'")
        data = data["train"]
    if data.num_rows == 0:
        raise MemkitError(f"--data {path} is empty; it needs at least one row")
    columns = set(data.column_names)
    if "text" in columns:
        kind, keys = "text", ("text",)
    elif {"prompt", "completion"} <= columns:
        kind, keys = "prompt_completion", ("prompt", "completion")
    else:
        raise MemkitError(f"--data {path} has columns {sorted(columns)}; expected 'text', or "
                          "'prompt' and 'completion'")
    columns_data = {key: data[key] for key in keys}
    records = []
    for row in range(data.num_rows):
        record = {key: columns_data[key][row] for key in keys}
        _record_kind(record, f"{path}: row {row}")
        record["_where"] = f"row {row}"
        records.append(record)
    return kind, records


# ---- packing --------------------------------------------------------------------------------

def prepare_data(source: str, tokenizer, *, seq_len: int, max_positions: int | None,
                 vocab_size: int, seed: int = 0) -> PackedData:
    """Read `source`, tokenize and pack it into sequences of exactly `seq_len` tokens."""
    if max_positions is not None and seq_len > max_positions:
        raise MemkitError(f"--seq-len {seq_len} is longer than the model allows "
                          f"(max_position_embeddings={max_positions}); use --seq-len <= {max_positions}")
    if source == SYNTHETIC or source.startswith(SYNTHETIC + ":"):
        return _synthetic(source, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    kind, records = read_records(source)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if kind == "text":
        ids = tokenizer([r["text"] for r in records], add_special_tokens=False)["input_ids"]
        return _pack_text(ids, eos=eos, seq_len=seq_len, source=source)
    prompts = tokenizer([r["prompt"] for r in records], add_special_tokens=False)["input_ids"]
    completions = tokenizer([r["completion"] for r in records], add_special_tokens=False)["input_ids"]
    return _pack_prompt_completion(prompts, completions, [r["_where"] for r in records], eos=eos,
                                   pad=pad, seq_len=seq_len, source=source)


def _pack_text(docs: list[list[int]], *, eos: int, seq_len: int, source: str) -> PackedData:
    """Concatenate documents, each closed by EOS, and cut the stream into seq_len pieces
    (GPT-2/3 style packing: Radford et al. 2019; Brown et al. 2020, Sec. 2.3)."""
    stream = np.fromiter((tok for doc in docs for tok in (*doc, eos)), dtype=np.int64)
    num_sequences = len(stream) // seq_len
    if num_sequences == 0:
        raise MemkitError(f"--data {source} has {len(stream)} tokens, fewer than --seq-len {seq_len}; "
                          "add text or lower --seq-len")
    ids = torch.from_numpy(stream[: num_sequences * seq_len].reshape(num_sequences, seq_len).copy())
    return PackedData(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids),
                      kind="text", source=source, num_documents=len(docs),
                      num_dropped_tokens=len(stream) - num_sequences * seq_len)


def _pack_prompt_completion(prompts, completions, wheres, *, eos: int, pad: int, seq_len: int,
                            source: str) -> PackedData:
    """Greedy in-order packing of whole examples; the loss is on completion + EOS only."""
    rows_ids, rows_labels, rows_mask = [], [], []
    cur_ids: list[int] = []
    cur_labels: list[int] = []

    def close():
        used = len(cur_ids)
        rows_ids.append(cur_ids + [pad] * (seq_len - used))
        rows_labels.append(cur_labels + [IGNORE_INDEX] * (seq_len - used))
        rows_mask.append([1] * used + [0] * (seq_len - used))

    for prompt, completion, where in zip(prompts, completions, wheres):
        example = list(prompt) + list(completion) + [eos]
        if len(example) > seq_len:
            raise MemkitError(f"--data {source}: {where} has {len(example)} tokens (prompt + completion "
                              f"+ eos), longer than --seq-len {seq_len}; shorten it or raise --seq-len")
        if len(cur_ids) + len(example) > seq_len:
            close()
            cur_ids, cur_labels = [], []
        cur_ids += example
        cur_labels += [IGNORE_INDEX] * len(prompt) + list(completion) + [eos]
    close()
    return PackedData(input_ids=torch.tensor(rows_ids, dtype=torch.long),
                      labels=torch.tensor(rows_labels, dtype=torch.long),
                      attention_mask=torch.tensor(rows_mask, dtype=torch.long),
                      kind="prompt_completion", source=source, num_documents=len(prompts))


def _synthetic(source: str, *, seq_len: int, vocab_size: int, seed: int) -> PackedData:
    _, _, count = source.partition(":")
    try:
        num_sequences = int(count) if count else 256
    except ValueError:
        raise MemkitError(f"--data {source}: write '{SYNTHETIC}' or '{SYNTHETIC}:N' with N sequences") from None
    if num_sequences < 1:
        raise MemkitError(f"--data {source}: N must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_sequences, seq_len), generator=gen, dtype=torch.long)
    return PackedData(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids),
                      kind="synthetic", source=source, num_documents=num_sequences)


# ---- sharding ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Sharding:
    """Which sequences each rank trains on at each step: a pure function of (seed, step).

    Step s consumes global positions [s*G, (s+1)*G), G = micro x accum x dp. Position p is
    sequence perm_e[p mod N] of epoch e = p // N (a fresh seeded permutation per epoch, or the
    identity without shuffling). Within a step, micro-step j of rank r takes positions
    s*G + (j*dp + r)*micro + [0, micro).
    """

    num_sequences: int
    micro_batch_size: int
    grad_accum: int
    dp: int
    seed: int = 0
    shuffle: bool = True

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp

    def sequence_at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.num_sequences
        offsets = positions % self.num_sequences
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[offsets[sel]]
        return out

    def step_indices(self, step: int) -> np.ndarray:
        """Sequence indices of step `step`, shape [grad_accum, dp, micro_batch_size]."""
        start = step * self.global_batch_size
        positions = np.arange(start, start + self.global_batch_size, dtype=np.int64)
        return self.sequence_at(positions).reshape(self.grad_accum, self.dp, self.micro_batch_size)

    def rank_micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        """The `grad_accum` micro-batches (sequence indices) rank `rank` trains on at `step`."""
        if not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} outside data-parallel world of {self.dp}")
        return list(self.step_indices(step)[:, rank, :])

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch_size / self.num_sequences

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_sequences)
        return _permutation(self.seed, epoch, self.num_sequences)


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, num_sequences: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_sequences)
