"""Runner data formats: alpaca, chat messages / ShareGPT, .json / .csv / .parquet / datasets
folders, --packing off and the eval split. Labels are checked token by token: the loss is on
the answer (assistant turns) only."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from memkit.errors import MemkitError
from memkit.train.chat import ALPACA_PROMPT_NO_INPUT, FALLBACK_CHAT_TEMPLATE
from memkit.train.data import IGNORE_INDEX, prepare_data
from memkit.train.tokenizer import byte_tokenizer

EOS = byte_tokenizer().eos_token_id
PAD = byte_tokenizer().pad_token_id
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""The ChatML layout (Qwen / OpenAI ChatML) written as a Jinja chat template."""
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


def _tok(template=None):
    tok = copy.deepcopy(byte_tokenizer())  # the cached one gets the fallback template set on it
    tok.chat_template = template
    return tok


def _prep(source, tok, seq_len=256, **kw):
    return prepare_data(str(source), tok, seq_len=seq_len, max_positions=None, vocab_size=320, **kw)


def _target_text(data, row=0) -> str:
    """The bytes that carry a label in one row (byte tokenizer: id == byte; EOS shown as <eos>)."""
    out = []
    for tok in data.labels[row].tolist():
        if tok != IGNORE_INDEX:
            out.append("<eos>" if tok == EOS else chr(tok))
    return "".join(out)


def test_alpaca_json_array_loss_on_output_only(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "Say hi", "input": "", "output": "hi"},
                                {"instruction": "Add", "input": "2 and 2", "output": "4"}]))
    data = _prep(path, _tok(), seq_len=512, packing=False)
    assert data.kind == "alpaca" and data.num_sequences == 2
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi")
    used = len(prompt) + 2 + 1
    assert data.input_ids[0, :used].tolist() == [*prompt.encode(), *b"hi", EOS]
    assert data.labels[0, :used].tolist() == [IGNORE_INDEX] * len(prompt) + [*b"hi", EOS]
    assert _target_text(data, 1) == "4<eos>"
    assert "### Input:\n2 and 2" in bytes(data.input_ids[1][data.attention_mask[1] == 1].tolist()[:-2]).decode()


def test_chat_messages_fallback_template_masks_all_but_assistant(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    tok = _tok()
    data = _prep(path, tok, packing=False)
    assert tok.chat_template == FALLBACK_CHAT_TEMPLATE  # set on the tokenizer: final/ carries it
    text = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello<eos><|user|>\n2+2?\n<|assistant|>\n4<eos>"
    ids = data.input_ids[0][data.attention_mask[0] == 1].tolist()
    assert "".join("<eos>" if t == EOS else chr(t) for t in ids) == text
    assert _target_text(data) == "Hello<eos>4<eos>"
    assert data.loss_tokens.tolist() == [len("Hello") + 1 + len("4") + 1]


def test_chat_uses_the_tokenizers_own_template(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    data = _prep(path, _tok(CHATML), packing=False)
    assert _target_text(data) == "Hello<|im_end|>\n4<|im_end|>\n"  # the end-of-turn marker is learned
    first = bytes(data.input_ids[0, :60].tolist()).decode()
    assert first.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_sharegpt_parquet_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"conversations": [[{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}],
                              [{"from": "system", "value": "s"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}]]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "sg.parquet"))
    data = _prep(tmp_path / "sg.parquet", _tok(CHATML), packing=True)
    assert data.kind == "chat" and data.num_documents == 2 and data.num_sequences == 1  # packed together
    assert _target_text(data) == "Yo<|im_end|>\nA<|im_end|>\n"


def test_csv_prompt_completion_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "pc.csv").write_text("prompt,completion\nab,c\nde,fg\n")
    data = _prep(tmp_path / "pc.csv", _tok(), seq_len=8, packing=False)
    assert data.kind == "prompt_completion"
    assert data.input_ids.tolist() == [[*b"abc", EOS, PAD, PAD, PAD, PAD], [*b"defg", EOS, PAD, PAD, PAD]]
    assert data.labels[1].tolist() == [IGNORE_INDEX, IGNORE_INDEX, *b"fg", EOS] + [IGNORE_INDEX] * 3
    assert data.attention_mask.sum(dim=1).tolist() == [4, 5]


def test_datasets_folder_of_chat_records(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": [CHAT[1:3]]})}).save_to_disk(
        str(tmp_path / "dd"))
    data = _prep(tmp_path / "dd", _tok(), packing=False)
    assert _target_text(data) == "Hello<eos>"


def test_packing_off_one_document_per_row_long_ones_continue(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "defghij")))
    data = _prep(path, _tok(), seq_len=4, packing=False)
    assert data.input_ids.tolist() == [[*b"abc", EOS], [*b"defg"], [*b"hij", EOS]]
    packed = _prep(path, _tok(), seq_len=4, packing=True)
    assert packed.input_ids.tolist() == [[*b"abc", EOS], [*b"defg"], [*b"hij", EOS]]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("ab", "cd")))
    assert _prep(path, _tok(), seq_len=4, packing=False).input_ids.tolist() == [[*b"ab", EOS, PAD],
                                                                              [*b"cd", EOS, PAD]]
    assert _prep(path, _tok(), seq_len=3, packing=True).input_ids.tolist() == [[*b"ab", EOS], [*b"cd", EOS]]


def test_eval_fraction_holds_out_whole_records_and_eval_data(tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) + "\n" for i in range(10)))
    data = _prep(path, _tok(), seq_len=8, packing=False, eval_fraction=0.2, seed=1)
    assert data.num_sequences == 8 and data.eval.num_sequences == 2
    train_rows = {bytes(r[:4].tolist()) for r in data.input_ids}
    eval_rows = {bytes(r[:4].tolist()) for r in data.eval.input_ids}
    assert not train_rows & eval_rows and len(train_rows | eval_rows) == 10
    again = _prep(path, _tok(), seq_len=8, packing=False, eval_fraction=0.2, seed=1)
    assert torch.equal(again.eval.input_ids, data.eval.input_ids)  # a function of the seed
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"text": "held out text"}) + "\n")
    with_file = _prep(path, _tok(), seq_len=8, eval_source=str(other))
    assert with_file.eval.kind == "text" and with_file.eval.num_sequences == 1
    with pytest.raises(MemkitError, match=r"--eval-fraction 0.99 of 10 records .* leaves none to train on"):
        _prep(path, _tok(), seq_len=8, eval_fraction=0.99)


@pytest.mark.parametrize("record, match", [
    ({"messages": [{"role": "user", "content": "only a question"}]}, r"no assistant turn"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, r"from='robot'; use one of human"),
    ({"messages": []}, r"'messages' must be a non-empty list"),
    ({"instruction": "x", "output": ""}, r"'output' is empty"),
])
def test_bad_chat_and_alpaca_records(tmp_path, record, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(MemkitError, match=match):
        _prep(path, _tok())
