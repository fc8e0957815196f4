"""The runner's data for the task plans: encoder-decoder LMs (seq2seq), sequence classification
(--task seq-cls) and token classification (--task token-cls). One example per row, padded to fixed
shapes (the ones memkit prices): the source / text at --seq-len, a seq2seq target at --target-len.

    seq2seq     input_ids [N, seq_len] the source + EOS; labels [N, target_len] the target + EOS,
                IGNORE_INDEX on the padding; decoder_input_ids the labels shifted right behind the
                decoder start token (transformers models/bart/modeling_bart.py shift_tokens_right,
                which the model would apply itself when given labels)
    seq-cls     input_ids [N, seq_len] the text with the tokenizer's special tokens; labels [N]
    token-cls   input_ids [N, seq_len]; labels [N, seq_len]: a word's class id on its first
                sub-token, IGNORE_INDEX on later sub-tokens, special tokens and the padding (the
                Hugging Face course, "Token classification", align_labels_with_tokens)

Records are read and checked by records.py; here the lengths and class ids are checked against the
plan (one line each: which record, the value, the fix).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memkit.errors import MemkitError

IGNORE_INDEX = -100
"""Label that cross-entropy skips (torch.nn.functional.cross_entropy's default ignore_index)."""

KIND_OF_TASK = {"seq2seq": "seq2seq", "seq-cls": "classification", "token-cls": "token_classification"}
"""The record kind (records.py) each task trains on."""
FORMAT_OF_TASK = {"seq2seq": "'source' and 'target' strings",
                  "seq-cls": "'text' and an integer 'label'",
                  "token-cls": "'tokens' (a list of words) and 'labels' (a class id per word)"}


@dataclass(frozen=True, slots=True, kw_only=True)
class DataTask:
    """What the rows are for (memkit.train.model.data_task decides it from the plan and the model)."""

    task: str
    """'causal-lm', 'seq2seq' (an encoder-decoder's LM), 'seq-cls' or 'token-cls'."""
    num_labels: int = 2
    target_len: int = 0
    """Decoder tokens per row (seq2seq); 0 = the encoder's seq_len (TrainingPlan.target_len)."""
    decoder_start_token_id: int | None = None
    decoder_pad_token_id: int | None = None
    """The model config's ids that shift_tokens_right uses (seq2seq)."""

    @property
    def is_lm(self) -> bool:
        return self.task == "causal-lm"


def check_kind(kind: str, task: DataTask, *, what: str, where: str) -> None:
    """A record kind the task cannot train on: one line naming the format it needs."""
    if task.is_lm:
        if kind in ("seq2seq", "token_classification"):
            need = {"seq2seq": "an encoder-decoder (--model a BART / T5 config)",
                    "token_classification": "a --task token-cls plan"}[kind]
            raise MemkitError(f"{what}: {where} is a {kind} record, which trains {need}; this run trains a causal "
                              "LM on text / prompt-completion / alpaca / chat records")
        return
    if kind != KIND_OF_TASK[task.task]:
        flag = "an encoder-decoder model" if task.task == "seq2seq" else f"--task {task.task}"
        raise MemkitError(f"{what}: {where} is a {kind} record; {flag} trains on records with "
                          f"{FORMAT_OF_TASK[task.task]}")


def source_ids(kind: str, records: list[dict], tokenizer) -> list[list[int]]:
    """The encoder's input ids of each record (the source + EOS, the text with its special tokens, the
    words); also the lengths `--seq-len from-data` and `estimate --data` read."""
    if kind == "seq2seq":
        return _with_eos(tokenizer([r["source"] for r in records], add_special_tokens=True)["input_ids"], tokenizer)
    if kind == "classification":
        return [list(ids) for ids in tokenizer([r["text"] for r in records], add_special_tokens=True)["input_ids"]]
    return [ids for ids, _ in _token_rows(records, tokenizer)]


def task_rows(kind: str, records: list[dict], tokenizer, task: DataTask, *, seq_len: int, truncate: bool,
              what: str) -> dict:
    """PackedData's fields for the task: input_ids, attention_mask, labels (and decoder_input_ids),
    with num_truncated; every record checked first."""
    check_kind(kind, task, what=what, where=records[0]["_where"])
    target_len = task.target_len or seq_len
    if kind == "token_classification":
        pairs = _token_rows(records, tokenizer)
        sources, labels = [ids for ids, _ in pairs], [lab for _, lab in pairs]
    else:
        sources = source_ids(kind, records, tokenizer)
    _check_labels(kind, records, task, what=what)
    num_cut = _fit(sources, records, seq_len, truncate=truncate, what=what, flag="--seq-len", part="source")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = {"input_ids": _padded(sources, pad, seq_len),
           "attention_mask": _padded([[1] * len(s) for s in sources], 0, seq_len)}
    if kind == "classification":
        out["labels"] = torch.tensor([r["label"] for r in records], dtype=torch.long)
    elif kind == "token_classification":
        out["labels"] = _padded([lab[:seq_len] for lab in labels], IGNORE_INDEX, seq_len)
    else:
        targets = _with_eos(tokenizer([r["target"] for r in records], add_special_tokens=True)["input_ids"], tokenizer)
        num_cut += _fit(targets, records, target_len, truncate=truncate, what=what, flag="--target-len",
                        part="target")
        out["labels"] = _padded(targets, IGNORE_INDEX, target_len)
        out["decoder_input_ids"] = shift_right(out["labels"], start=task.decoder_start_token_id,
                                               pad=task.decoder_pad_token_id)
    return {**out, "num_truncated": num_cut}


def shift_right(labels: torch.Tensor, *, start: int | None, pad: int | None) -> torch.Tensor:
    """Decoder inputs from labels (transformers models/bart/modeling_bart.py shift_tokens_right)."""
    if start is None or pad is None:
        raise MemkitError("the encoder-decoder's config has no decoder_start_token_id / pad_token_id; set them in "
                          "its config.json (BART: 2 and 1, T5: 0 and 0)")
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad)


def _with_eos(ids_list, tokenizer) -> list[list[int]]:
    """Each sequence closed by EOS (the byte tokenizer adds no special tokens; BART / T5 add </s>)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise MemkitError("the tokenizer has no eos token, which closes a seq2seq source and target; set eos_token "
                          "in its tokenizer_config.json")
    return [list(ids) if ids and ids[-1] == eos else list(ids) + [eos] for ids in ids_list]


def _token_rows(records: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per record: the words tokenized as pre-split words (is_split_into_words), each
    word's class id on its first sub-token, IGNORE_INDEX elsewhere (word_ids() is None on specials)."""
    if not getattr(tokenizer, "is_fast", False):
        raise MemkitError("--task token-cls needs a fast tokenizer (tokenizer.json) to align word labels with "
                          "sub-tokens; put one in the model folder")
    try:
        enc = tokenizer([r["tokens"] for r in records], is_split_into_words=True, add_special_tokens=True)
    except Exception as exc:  # e.g. a byte-level BPE without add_prefix_space refuses pre-split words
        raise MemkitError(f"--task token-cls: the tokenizer cannot read pre-split words ({str(exc).splitlines()[0]}); "
                          "use a tokenizer that accepts is_split_into_words") from None
    rows = []
    for i, record in enumerate(records):
        labels, previous = [], None
        for word in enc.word_ids(i):
            labels.append(IGNORE_INDEX if word is None or word == previous else record["labels"][word])
            previous = word
        rows.append((list(enc["input_ids"][i]), labels))
    return rows


def _check_labels(kind: str, records: list[dict], task: DataTask, *, what: str) -> None:
    n = task.num_labels
    if kind == "seq2seq":
        return
    if kind == "classification" and n < 2:
        raise MemkitError(f"--num-labels {n}: a one-output head is a regression, which the runner does not train; "
                          "plan with --num-labels >= 2 (one per class)")
    for record in records:
        values = [record["label"]] if kind == "classification" else record["labels"]
        bad = [v for v in values if not (0 <= v < n or (kind == "token_classification" and v == IGNORE_INDEX))]
        if bad:
            biggest = max(v for v in values if v != IGNORE_INDEX)
            raise MemkitError(f"{what}: {record['_where']} has class id {bad[0]}, outside 0..{n - 1} for "
                              f"--num-labels {n}; fix the label or plan with --num-labels {max(n, biggest + 1)}")


def _fit(seqs: list[list[int]], records: list[dict], limit: int, *, truncate: bool, what: str, flag: str,
         part: str) -> int:
    """Cut sequences longer than `limit` to their first `limit` tokens under --truncate, else refuse the
    first; returns how many were cut."""
    too_long = [i for i, s in enumerate(seqs) if len(s) > limit]
    if too_long and not truncate:
        i = too_long[0]
        raise MemkitError(f"{what}: {records[i]['_where']} has a {len(seqs[i])}-token {part}, longer than {flag} "
                          f"{limit}; shorten it, raise {flag}, or pass --truncate to keep its first {limit} tokens "
                          f"({len(too_long)} record(s) too long)")
    for i in too_long:
        seqs[i] = seqs[i][:limit]
    return len(too_long)


def _padded(seqs: list[list[int]], fill: int, length: int) -> torch.Tensor:
    return torch.tensor([list(s) + [fill] * (length - len(s)) for s in seqs], dtype=torch.long)
