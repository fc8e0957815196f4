"""Runner data: reading, tokenizing, packing, bad input, deterministic sharding."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from memkit.errors import MemkitError
from memkit.train.data import IGNORE_INDEX, Sharding, prepare_data
from memkit.train.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOK = byte_tokenizer()
EOS = TOK.eos_token_id


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _prep(source, seq_len=8, max_positions=256):
    return prepare_data(str(source), TOK, seq_len=seq_len, max_positions=max_positions, vocab_size=320)


# ---- tokenizer ---------------------------------------------------------------------------------

def test_byte_tokenizer_ids_are_bytes_and_round_trip():
    text = "Héllo\n  wörld ✓"
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert len(TOK) == BYTE_VOCAB_SIZE == 258
    assert (TOK.eos_token_id, TOK.pad_token_id) == (256, 257)


def test_tokenizer_larger_than_model_vocab_is_an_error():
    with pytest.raises(MemkitError, match=r"258 tokens but the model's vocab_size is 200"):
        load_tokenizer(None, vocab_size=200)


# ---- packing -----------------------------------------------------------------------------------

def test_text_jsonl_packs_documents_with_eos(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "abc"}, {"text": "defgh"}, {"text": "ij"}])
    data = _prep(path, seq_len=4)
    stream = [*b"abc", EOS, *b"defgh", EOS, *b"ij", EOS]  # 13 tokens -> 3 sequences of 4, 1 dropped
    assert data.kind == "text" and data.num_documents == 3
    assert data.input_ids.tolist() == [stream[0:4], stream[4:8], stream[8:12]]
    assert torch.equal(data.labels, data.input_ids)
    assert data.num_dropped_tokens == 1
    assert data.loss_tokens.tolist() == [3, 3, 3]  # seq_len - 1 next-token targets each


def test_prompt_completion_loss_on_completion_only(tmp_path):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "ab", "completion": "c"},
                                          {"prompt": "de", "completion": "fg"},
                                          {"prompt": "hijk", "completion": "l"}])
    data = _prep(path, seq_len=8)
    pad, I = TOK.pad_token_id, IGNORE_INDEX
    # Examples: ab|c<eos> (4), de|fg<eos> (5), hijk|l<eos> (6); greedy in order: [1], [2], [3].
    assert data.input_ids.tolist() == [
        [*b"abc", EOS, pad, pad, pad, pad],
        [*b"defg", EOS, pad, pad, pad],
        [*b"hijkl", EOS, pad, pad],
    ]
    assert data.labels.tolist() == [
        [I, I, ord("c"), EOS, I, I, I, I],
        [I, I, ord("f"), ord("g"), EOS, I, I, I],
        [I, I, I, I, ord("l"), EOS, I, I],
    ]
    assert data.attention_mask.sum(dim=1).tolist() == [4, 5, 6]
    assert data.loss_tokens.tolist() == [2, 3, 2]


def test_prompt_completion_examples_share_a_sequence_when_they_fit(tmp_path):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}] * 3)  # 3 tokens each
    data = _prep(path, seq_len=7)
    assert data.num_sequences == 2
    assert data.input_ids[0, :6].tolist() == [ord("a"), ord("b"), EOS] * 2


def test_txt_splits_documents_at_blank_lines(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("first para\nline two\n\n\nsecond\n")
    data = _prep(path, seq_len=4)
    assert data.kind == "text" and data.num_documents == 2
    stream = [*b"first para\nline two", EOS, *b"second\n", EOS]
    assert data.input_ids.flatten().tolist() == stream[: data.num_sequences * 4]


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["hello", "world"]}).save_to_disk(str(tmp_path / "ds"))
    data = _prep(tmp_path / "ds", seq_len=4)
    assert data.input_ids.flatten().tolist() == [*b"hello", EOS, *b"world", EOS]
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(MemkitError, match=r"splits \['validation'\] but no 'train'"):
        _prep(tmp_path / "dd")
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "cols"))
    with pytest.raises(MemkitError, match=r"row 0 has fields \['body'\]; expected 'text'"):
        _prep(tmp_path / "cols")


def test_shipped_data_sets_load():
    text = _prep(REPO / "launch" / "data" / "text.jsonl", seq_len=64)
    qa = _prep(REPO / "launch" / "data" / "qa.jsonl", seq_len=64)
    assert text.kind == "text" and text.num_documents == 240 and text.num_sequences >= 64
    assert qa.kind == "prompt_completion" and qa.num_documents == 240
    # Unequal target counts per sequence: what makes token-normalised accumulation matter.
    assert len(set(qa.loss_tokens.tolist())) > 1


def test_synthetic_is_seeded():
    a = prepare_data("synthetic:5", TOK, seq_len=16, max_positions=None, vocab_size=1000, seed=3)
    b = prepare_data("synthetic:5", TOK, seq_len=16, max_positions=None, vocab_size=1000, seed=3)
    assert a.input_ids.shape == (5, 16) and torch.equal(a.input_ids, b.input_ids)
    assert int(a.input_ids.max()) < 1000 and a.fingerprint() == b.fingerprint()


# ---- bad data: one clear line each ---------------------------------------------------------------

@pytest.mark.parametrize("lines, match", [
    (None, r"no such file or folder"),
    ([], r"is empty; it needs at least one record"),
    (["", "   "], r"is empty \(only blank lines\)"),
    (['{"text": "ok"}', "{not json"], r"line 2 is not JSON"),
    (['["a list"]'], r"line 1 is a list, not an object"),
    (['{"txt": "typo"}'], r"line 1 has fields \['txt'\]; expected 'text', or 'prompt' and 'completion'"),
    (['{"prompt": "only a prompt"}'], r"has fields \['prompt'\]"),
    (['{"text": 3}'], r"line 1: 'text' is a int; it must be a string"),
    (['{"prompt": "p", "completion": ""}'], r"line 1: 'completion' is empty"),
    (['{"text": "a"}', '{"prompt": "p", "completion": "c"}'], r"line 2 is a prompt_completion record but "
                                                              r"earlier lines are text records"),
])
def test_bad_jsonl(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    if lines is not None:
        path.write_text("".join(line + "\n" for line in lines) if lines else "")
    with pytest.raises(MemkitError, match=match):
        _prep(path)


def test_sequence_longer_than_model_allows(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "x" * 100}])
    with pytest.raises(MemkitError, match=r"--seq-len 512 is longer than the model allows "
                                          r"\(max_position_embeddings=256\)"):
        _prep(path, seq_len=512, max_positions=256)


def test_example_longer_than_seq_len(tmp_path):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "ok", "completion": "y"},
                                          {"prompt": "p" * 20, "completion": "c" * 20}])
    with pytest.raises(MemkitError, match=r"line 2 has 41 tokens .* longer than --seq-len 16"):
        _prep(path, seq_len=16)


def test_too_little_text_for_one_sequence(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])
    with pytest.raises(MemkitError, match=r"has 4 tokens, fewer than --seq-len 64"):
        _prep(path, seq_len=64)


def test_unknown_extension_and_plain_folder(tmp_path):
    (tmp_path / "x.xyz").write_text("a,b\n")
    with pytest.raises(MemkitError, match=r"unknown file type '.xyz'"):
        _prep(tmp_path / "x.xyz")
    (tmp_path / "folder").mkdir()
    with pytest.raises(MemkitError, match=r"not a datasets folder"):
        _prep(tmp_path / "folder")


# ---- sharding ------------------------------------------------------------------------------------

def test_each_step_uses_global_batch_disjointly_and_ranks_partition_it():
    shard = Sharding(num_sequences=100, micro_batch_size=2, grad_accum=3, dp=4, seed=7)
    seen = []
    for step in range(4):  # 4 x 24 = 96 < 100: one epoch, no repeats
        per_rank = [np.concatenate(shard.rank_micro_batches(step, r)) for r in range(4)]
        assert all(len(x) == 6 for x in per_rank)
        union = np.concatenate(per_rank)
        assert len(set(union.tolist())) == 24
        seen += union.tolist()
    assert len(set(seen)) == 96


def test_order_depends_only_on_seed_and_step():
    a = Sharding(num_sequences=50, micro_batch_size=1, grad_accum=4, dp=2, seed=1)
    b = Sharding(num_sequences=50, micro_batch_size=1, grad_accum=4, dp=2, seed=1)
    # A resumed run computes step 9's batches from scratch: same as the run that got there.
    assert np.array_equal(a.step_indices(9), b.step_indices(9))
    c = Sharding(num_sequences=50, micro_batch_size=1, grad_accum=4, dp=2, seed=2)
    assert not np.array_equal(a.step_indices(0), c.step_indices(0))


def test_same_global_batch_for_any_micro_accum_split():
    """micro 1 x accum 4 and micro 4 x accum 1 train on the same 8 sequences per step."""
    one = Sharding(num_sequences=40, micro_batch_size=1, grad_accum=4, dp=2, seed=0)
    four = Sharding(num_sequences=40, micro_batch_size=4, grad_accum=1, dp=2, seed=0)
    for step in range(3):
        assert sorted(one.step_indices(step).ravel()) == sorted(four.step_indices(step).ravel())


def test_epochs_wrap_with_a_fresh_permutation():
    shard = Sharding(num_sequences=5, micro_batch_size=1, grad_accum=1, dp=1, seed=0)
    first = [int(shard.step_indices(s)[0, 0, 0]) for s in range(5)]
    second = [int(shard.step_indices(s)[0, 0, 0]) for s in range(5, 10)]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3, 4]
    assert shard.epoch_of(10) == 2.0
    plain = Sharding(num_sequences=5, micro_batch_size=1, grad_accum=1, dp=1, shuffle=False)
    assert [int(plain.step_indices(s)[0, 0, 0]) for s in range(7)] == [0, 1, 2, 3, 4, 0, 1]
