"""Training data: read, tokenize, pack to --seq-len, hold out an eval set, and shard across
data-parallel ranks.

Sources and record formats (text, prompt/completion, alpaca, chat messages / ShareGPT; .jsonl,
.json, .csv, .parquet, .txt, datasets folders): records.py; the loss masks of instruction and
chat records: chat.py. `synthetic[:N]` is seeded random tokens (for `verify`).

Every rank reads and packs the whole data set the same way, so the sequence at each position
of the run is known everywhere and the order is a pure function of (seed, step): a resumed run
continues at exactly the same sample, and each rank can count the loss tokens of the whole
accumulation window without communicating (see loop.py, loss normalisation).
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from memkit.errors import MemkitError
from memkit.train.records import SYNTHETIC, read_records
from memkit.train.task_data import IGNORE_INDEX, FORMAT_OF_TASK, DataTask, check_kind, task_rows  # noqa: F401 (IGNORE_INDEX: loop.py reads it here)

LM_TASK = DataTask(task="causal-lm")



@dataclass(frozen=True, slots=True, kw_only=True)
class PackedData:
    """Fixed-length training sequences, shape [num_sequences, seq_len] each."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    """Next-token targets are labels[:, 1:]; IGNORE_INDEX where no loss is taken. The task rows
    (task_data.py): a seq2seq target [N, target_len], a class id per row [N], a class id per token."""
    attention_mask: torch.Tensor
    kind: str
    """'text', 'prompt_completion', 'alpaca', 'chat', 'synthetic', or a task's ('seq2seq',
    'classification', 'token_classification')."""
    task: str = "causal-lm"
    """What the labels train (task_data.DataTask.task): 'causal-lm', 'seq2seq', 'seq-cls', 'token-cls'."""
    decoder_input_ids: "torch.Tensor | None" = None
    """seq2seq: the labels shifted right behind the decoder start token; None otherwise."""
    source: str
    num_documents: int
    num_dropped_tokens: int = 0
    """Tail tokens of a text stream that did not fill a last sequence."""
    num_truncated: int = 0
    """Examples cut to --seq-len by --truncate (their first seq_len tokens kept)."""
    position_ids: "torch.Tensor | None" = None
    """--packing isolated: positions restarting at 0 at each example (and at the padding), so that
    transformers builds a block-diagonal causal mask and no example attends to another (masking_utils.
    _preprocess_mask_arguments -> find_packed_sequence_indices, when attention_mask is None); None
    otherwise (positions 0..seq_len-1, the mask as attention_mask says)."""
    eval: "PackedData | None" = None
    """The held-out eval set (--eval-data / --eval-fraction), packed the same way; None without one."""
    loss_tokens: torch.Tensor = field(init=False)
    """Per sequence: how many positions contribute to the loss (shifted labels != IGNORE_INDEX)."""
    digest: str = field(init=False, repr=False)
    """sha256 prefix of the packed tokens and labels (see fingerprint)."""

    def __post_init__(self):
        targets = self.labels[:, 1:] if self.task == "causal-lm" else self.labels  # only the LM shifts
        valid = targets != IGNORE_INDEX
        object.__setattr__(self, "loss_tokens", valid.sum(dim=1) if valid.dim() == 2 else valid.long())
        digest = hashlib.sha256()
        digest.update(self.input_ids.numpy().tobytes())
        digest.update(self.labels.numpy().tobytes())
        object.__setattr__(self, "digest", digest.hexdigest()[:16])

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def target_len(self) -> int:
        """Decoder tokens per row of a seq2seq set; 0 otherwise."""
        return int(self.labels.shape[1]) if self.task == "seq2seq" else 0

    def fingerprint(self) -> str:
        """sha256 of the packed tokens and labels: a resumed run checks it saw the same data.

        Hashed when the data are packed, before the runner's LiveTensorTracker starts: under it,
        .numpy() dispatches aten.detach, whose output shares the data set's storage, and the
        tracker then counted the host-side data set (input_ids + labels, int64) as device memory
        -- 263 KB of the 3.7 MB peak in tests/e2e/test_runner_techniques.py (measured)."""
        return self.digest

    def batch(self, indices) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        out = {"input_ids": self.input_ids[index], "labels": self.labels[index],
               "attention_mask": self.attention_mask[index]}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids[index]
        if self.decoder_input_ids is not None:
            out["decoder_input_ids"] = self.decoder_input_ids[index]
        return out


# ---- tokenizing and packing -----------------------------------------------------------------

_RECURRENT_MIXERS = ("Mamba", "GatedDeltaNet", "LinearAttention", "Rwkv")
"""Layers that carry a state along the sequence (a hybrid's SSM / linear-attention blocks): an
example after another in a packed row would still see it through that state, whatever the mask."""


def isolation_unsupported(model_config) -> str | None:
    """None when `--packing isolated` keeps each example to itself on this model, else why not.
    Isolation needs the causal LM to take position_ids and to build its mask with transformers'
    masking_utils (create_causal_mask / create_sliding_window_causal_mask), which turns positions
    restarting at 0 into a block-diagonal mask (masking_utils._preprocess_mask_arguments ->
    find_packed_sequence_indices); measured on the tiny Llama: tests/unit/test_packing_isolated.py."""
    import importlib
    import inspect

    from transformers import masking_utils
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(model_config, "model_type", None)
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if cls_name is None:
        return f"{model_type} is not a transformers causal LM"
    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return f"transformers has no modeling_{name} module"
    if "position_ids" not in inspect.signature(getattr(module, cls_name).forward).parameters:
        return f"{cls_name} takes no position_ids"
    makers = (masking_utils.create_causal_mask, masking_utils.create_sliding_window_causal_mask)
    if not any(any(getattr(module, attr) is maker for maker in makers) for attr in dir(module)):
        return f"{cls_name} does not build its mask with transformers.masking_utils"
    recurrent = [attr for attr in dir(module) if any(m in attr for m in _RECURRENT_MIXERS)]
    if recurrent:
        return f"{cls_name} has recurrent layers ({recurrent[0]}) that carry state across examples"
    return None


def resolve_packing(choice: str | None, model_config, *, pipeline: bool = False) -> tuple[str, str]:
    """(--packing mode, a note for the run start) for the flag as given (None: the default).
    The default packs examples isolated (each attends only to itself) where the model allows it,
    else `on` (examples see the earlier ones in their row), and says which and why. pipeline: a
    pp > 1 plan, whose stages get input ids only (memkit.train.parallel.PipelineRunner.step)."""
    why = "the pipeline stages take no position ids" if pipeline else isolation_unsupported(model_config)
    if choice == "isolated" and why is not None:
        raise MemkitError(f"--packing isolated: {why}; use --packing on (packed examples attend to the earlier "
                          "ones) or --packing off (one example per sequence)")
    if choice is not None:
        return choice, ""
    if why is None:
        return "isolated", "the default; --packing on lets packed examples attend to the earlier ones"
    return "on", f"the default, as {why}: packed examples attend to the earlier ones (--packing off keeps them apart)"


def prepare_data(source: str, tokenizer, *, seq_len: int, max_positions: int | None, vocab_size: int,
                 seed: int = 0, packing: bool = True, eval_source: str | None = None,
                 eval_fraction: float = 0.0, truncate: bool = False, isolate: bool = False,
                 task: DataTask = LM_TASK) -> PackedData:
    """Read `source`, tokenize it and cut it into sequences of exactly `seq_len` tokens.

    packing=True: text is one EOS-separated stream cut every seq_len tokens, and whole examples
    share a sequence while they fit; packing=False: one document or example per (padded)
    sequence, a document longer than seq_len continuing in the next sequences.
    An eval set (from `eval_source`, or `eval_fraction` of the records held out before packing,
    chosen by `seed`) is prepared the same way and returned as `.eval`. An example (prompt +
    answer, or a conversation) longer than seq_len is an error, or with truncate=True keeps its
    first seq_len tokens (TRL's SFTConfig truncation_mode="keep_start", its default). isolate=True
    (--packing isolated) packs examples as packing=True does, each attending only to itself
    (PackedData.position_ids); text streams are unaffected. A task other than the causal LM
    (seq2seq, seq-cls, token-cls) takes one example per row, padded (memkit/train/task_data.py).
    """
    if max_positions is not None and seq_len > max_positions:
        raise MemkitError(f"--seq-len {seq_len} is longer than the model allows "
                          f"(max_position_embeddings={max_positions}); use --seq-len <= {max_positions}")
    if eval_source is not None and eval_fraction:
        raise MemkitError("--eval-data and --eval-fraction both given; use one")
    if not 0 <= eval_fraction < 1:
        raise MemkitError(f"--eval-fraction {eval_fraction} must be in [0, 1)")
    if _is_synthetic(source):
        if not task.is_lm:
            raise MemkitError(f"--data {source}: synthetic data are random tokens with no {task.task} labels; pass "
                              f"records with {FORMAT_OF_TASK[task.task]}")
        data = _synthetic(source, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
        return _split_synthetic(data, eval_fraction) if eval_fraction else data
    kind, records = read_records(source)
    eval_data = None
    common = {"truncate": truncate, "isolate": isolate, "task": task}
    if eval_fraction:
        records, held_out = _hold_out(records, eval_fraction, seed=seed, source=source)
        eval_data = _tokenize_and_pack(kind, held_out, tokenizer, seq_len=seq_len, packing=packing,
                                       source=f"{source} (eval {eval_fraction:g})", what="--eval-fraction", **common)
    elif eval_source is not None:
        eval_kind, eval_records = read_records(eval_source, flag="--eval-data")
        eval_data = _tokenize_and_pack(eval_kind, eval_records, tokenizer, seq_len=seq_len,
                                       packing=packing, source=eval_source, what=f"--eval-data {eval_source}",
                                       **common)
    data = _tokenize_and_pack(kind, records, tokenizer, seq_len=seq_len, packing=packing, source=source,
                              what=f"--data {source}", **common)
    return data if eval_data is None else dataclasses.replace(data, eval=eval_data)


SEQ_LEN_MULTIPLE = 64
"""--seq-len from the data is rounded up to this: GEMM shapes that fill whole tiles (NVIDIA, "Matrix
Multiplication Background User's Guide", Tile Quantization: a dimension one past a multiple of the
tile size costs a whole extra tile; cuBLAS tiles are 64 or 128 wide)."""
TEXT_SEQ_LEN_CAP = 2048
"""A text stream is cut into sequences of any length; from the data it gets at most `memkit suggest`'s
default --seq-len (memkit/cli/suggest.py)."""


def seq_len_from_data(source: str, tokenizer, *, max_positions: int | None) -> tuple[int, str]:
    """(--seq-len, the line that says where it came from) for the records of `source`, tokenized as
    the runner does (seq_len_for_lengths)."""
    if _is_synthetic(source):
        raise MemkitError(f"--seq-len from-data: --data {source} is synthetic and has no lengths; pass --seq-len N")
    return seq_len_for_lengths(*example_lengths_and_kind(source, tokenizer), max_positions=max_positions)


def seq_len_for_lengths(lengths: list[int], kind: str, *, max_positions: int | None) -> tuple[int, str]:
    """(--seq-len, why): the longest tokenized example (prompt + answer, or a conversation, with its
    EOS) rounded up to SEQ_LEN_MULTIPLE, so that no example is refused or cut; at most
    max_position_embeddings (then the longer ones need --truncate). Text documents: the same, at
    most TEXT_SEQ_LEN_CAP (a stream is packed across documents anyway). `kind`: read_records'."""
    import math

    lengths = sorted(lengths)
    longest, p99 = lengths[-1], lengths[min(len(lengths) - 1, math.ceil(0.99 * len(lengths)) - 1)]
    seq_len = math.ceil(longest / SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE
    why = f"the longest of {len(lengths):,} {kind} records is {longest:,} tokens (p99 {p99:,}), rounded up " \
          f"to a multiple of {SEQ_LEN_MULTIPLE}"
    caps = [(TEXT_SEQ_LEN_CAP, "text is packed as one stream, so sequences need not hold a whole document")] \
        if kind == "text" else []
    if max_positions is not None:
        caps.append((max_positions, f"the model's max_position_embeddings; {sum(n > max_positions for n in lengths):,} "
                                    "longer record(s) need --truncate"))
    for cap, because in sorted(caps):
        if seq_len > cap:
            seq_len, why = cap, f"{why}, capped at {cap:,} ({because})"
            break
    return seq_len, f"--seq-len {seq_len} from the data: {why}"


def _is_synthetic(source: str) -> bool:
    return source == SYNTHETIC or source.startswith(SYNTHETIC + ":")


def _hold_out(records: list[dict], fraction: float, *, seed: int, source: str):
    """(train records, eval records): round(fraction x N) records, at least 1, picked by a seeded
    permutation and kept in file order."""
    num_eval = max(1, round(fraction * len(records)))
    if num_eval >= len(records):
        raise MemkitError(f"--eval-fraction {fraction:g} of {len(records)} records in {source} leaves "
                          "none to train on; lower it or add data")
    chosen = set(np.random.default_rng([seed, 1]).permutation(len(records))[:num_eval].tolist())
    return ([r for i, r in enumerate(records) if i not in chosen],
            [r for i, r in enumerate(records) if i in chosen])


EXAMPLE_PARTS = {"prompt_completion": "prompt + completion + eos", "alpaca": "prompt + output + eos",
                 "chat": "the conversation rendered with its chat template"}


def example_lengths(source: str, tokenizer) -> list[int]:
    """Tokens per example of `source` as the runner tokenizes it (_examples: text documents with
    their EOS, prompt + completion / alpaca + EOS, chat rendered by its template), in file order:
    the length histogram `memkit estimate --data` prices (memkit/estimate/varlen.py)."""
    return example_lengths_and_kind(source, tokenizer)[0]


def example_lengths_and_kind(source: str, tokenizer) -> tuple[list[int], str]:
    """example_lengths and the records' kind (read_records')."""
    if _is_synthetic(source):
        raise MemkitError(f"--data {source}: synthetic data has no lengths of its own; pass a file, or --lengths")
    kind, records = read_records(source)
    return [len(ids) for ids, _ in _examples(kind, records, tokenizer, what=f"--data {source}")], kind


def _examples(kind: str, records: list[dict], tokenizer, *, what: str) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of each record, before packing or padding."""
    from memkit.train.chat import alpaca_prompt, chat_example, ensure_chat_template

    from memkit.train.task_data import source_ids

    eos = tokenizer.eos_token_id
    if kind in ("seq2seq", "classification", "token_classification"):  # the encoder's tokens
        return [(ids, ids) for ids in source_ids(kind, records, tokenizer)]
    if kind == "text":
        ids = tokenizer([r["text"] for r in records], add_special_tokens=False)["input_ids"]
        return [(list(doc) + [eos], list(doc) + [eos]) for doc in ids]
    if kind == "chat":
        ensure_chat_template(tokenizer)
        return [chat_example(tokenizer, r["messages"], where=f"{what}: {r['_where']}") for r in records]
    if kind == "alpaca":
        prompts_text, answers_text = [alpaca_prompt(r) for r in records], [r["output"] for r in records]
    else:
        prompts_text, answers_text = [r["prompt"] for r in records], [r["completion"] for r in records]
    prompts = tokenizer(prompts_text, add_special_tokens=False)["input_ids"]
    answers = tokenizer(answers_text, add_special_tokens=False)["input_ids"]
    return [(list(p) + list(a) + [eos], [IGNORE_INDEX] * len(p) + list(a) + [eos])
            for p, a in zip(prompts, answers)]


def _tokenize_and_pack(kind: str, records: list[dict], tokenizer, *, seq_len: int, packing: bool,
                       source: str, what: str, truncate: bool = False, isolate: bool = False,
                       task: DataTask = LM_TASK) -> PackedData:
    check_kind(kind, task, what=what, where=records[0]["_where"])
    if not task.is_lm:
        rows = task_rows(kind, records, tokenizer, task, seq_len=seq_len, truncate=truncate, what=what)
        return PackedData(**rows, kind=kind, task=task.task, source=source, num_documents=len(records))
    if kind == "classification":  # a causal LM trains on the text and leaves the label (records.py)
        kind = "text"
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    examples = _examples(kind, records, tokenizer, what=what)
    if kind == "text":
        if packing:  # _pack_text closes each document with its EOS itself
            return _pack_text([ids[:-1] for ids, _ in examples], eos=eos, seq_len=seq_len, source=source, what=what)
        return _one_per_row(examples, kind=kind, pad=pad, seq_len=seq_len, source=source)
    too_long = [i for i, (ids, _) in enumerate(examples) if len(ids) > seq_len]
    if too_long and not truncate:
        ids, record = examples[too_long[0]][0], records[too_long[0]]
        raise MemkitError(f"{what}: {record['_where']} has {len(ids)} tokens ({EXAMPLE_PARTS[kind]}), "
                          f"longer than --seq-len {seq_len}; shorten it, raise --seq-len, or pass --truncate "
                          f"to keep each example's first {seq_len} tokens ({len(too_long)} example(s) too long)")
    for i in too_long:  # --truncate: keep the start (the prompt and the answer's beginning)
        examples[i] = (examples[i][0][:seq_len], examples[i][1][:seq_len])
    if packing:
        packed = _pack_examples(examples, kind=kind, pad=pad, seq_len=seq_len, source=source, isolate=isolate)
    else:
        packed = _one_per_row(examples, kind=kind, pad=pad, seq_len=seq_len, source=source)
    return dataclasses.replace(packed, num_truncated=len(too_long)) if too_long else packed


def _pack_text(docs: list[list[int]], *, eos: int, seq_len: int, source: str, what: str) -> PackedData:
    """Concatenate documents, each closed by EOS, and cut the stream into seq_len pieces
    (GPT-2/3 style packing: Radford et al. 2019; Brown et al. 2020, Sec. 2.3)."""
    stream = np.fromiter((tok for doc in docs for tok in (*doc, eos)), dtype=np.int64)
    num_sequences = len(stream) // seq_len
    if num_sequences == 0:
        raise MemkitError(f"{what} has {len(stream)} tokens, fewer than --seq-len {seq_len}; "
                          "add text or lower --seq-len")
    ids = torch.from_numpy(stream[: num_sequences * seq_len].reshape(num_sequences, seq_len).copy())
    return PackedData(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids),
                      kind="text", source=source, num_documents=len(docs),
                      num_dropped_tokens=len(stream) - num_sequences * seq_len)


def _rows(rows, *, kind: str, pad: int, seq_len: int, source: str, num_documents: int,
          positions=None) -> PackedData:
    """PackedData from (ids, labels) rows of <= seq_len tokens, right-padded (labels IGNORE_INDEX,
    attention_mask 0 on the padding)."""
    def padded(values, fill):
        return [list(v) + [fill] * (seq_len - len(v)) for v in values]

    return PackedData(input_ids=torch.tensor(padded([r[0] for r in rows], pad), dtype=torch.long),
                      labels=torch.tensor(padded([r[1] for r in rows], IGNORE_INDEX), dtype=torch.long),
                      attention_mask=torch.tensor(padded([[1] * len(r[0]) for r in rows], 0), dtype=torch.long),
                      kind=kind, source=source, num_documents=num_documents,
                      position_ids=None if positions is None else torch.tensor(
                          [list(p) + list(range(seq_len - len(p))) for p in positions], dtype=torch.long))


def packed_row_groups(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Greedy in-order packing of whole examples (none is split across sequences): the indices of
    the examples each sequence holds. A row closes when the next example would overflow it (an
    example longer than seq_len gets a row of its own; the caller refuses or truncates it)."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and groups[-1] and used + n > seq_len:
            groups.append([])
            used = 0
        if not groups:
            groups.append([])
        groups[-1].append(i)
        used += n
    return groups or [[]]


def _pack_examples(examples, *, kind: str, pad: int, seq_len: int, source: str, isolate: bool = False) -> PackedData:
    """packed_row_groups' rows; isolate=True: each example's positions start at 0
    (PackedData.position_ids)."""
    examples = list(examples)
    rows: list[tuple[list[int], list[int]]] = []
    positions: list[list[int]] = []
    for group in packed_row_groups([len(ids) for ids, _ in examples], seq_len):
        rows.append(([t for i in group for t in examples[i][0]], [t for i in group for t in examples[i][1]]))
        positions.append([p for i in group for p in range(len(examples[i][0]))])
    return _rows(rows, kind=kind, pad=pad, seq_len=seq_len, source=source, num_documents=len(examples),
                 positions=positions if isolate else None)


def _one_per_row(examples, *, kind: str, pad: int, seq_len: int, source: str) -> PackedData:
    """--packing off: each example alone in its sequence(s); longer ones continue in the next."""
    rows = [(ids[i:i + seq_len], labels[i:i + seq_len])
            for ids, labels in examples for i in range(0, len(ids), seq_len)]
    return _rows(rows, kind=kind, pad=pad, seq_len=seq_len, source=source, num_documents=len(examples))


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


def _split_synthetic(data: PackedData, fraction: float) -> PackedData:
    num_eval = max(1, round(fraction * data.num_sequences))
    if num_eval >= data.num_sequences:
        raise MemkitError(f"--eval-fraction {fraction:g} of {data.num_sequences} synthetic sequences leaves "
                          "none to train on")
    cut = data.num_sequences - num_eval

    def part(sl, source):
        return PackedData(input_ids=data.input_ids[sl], labels=data.labels[sl],
                          attention_mask=data.attention_mask[sl], kind=data.kind, source=source,
                          num_documents=int(data.input_ids[sl].shape[0]))

    return dataclasses.replace(part(slice(0, cut), data.source),
                               eval=part(slice(cut, None), f"{data.source} (eval {fraction:g})"))


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
