"""Bad input to the runner is one clear line on stderr and exit code 2, before any process group
exists (launch/finetune.py directly, and `memkit train`, which checks before it launches)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runner_util import FINETUNE, REPO, TEXT_DATA, env, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_llama(folder)
    return folder


def _stderr_lines(cmd):
    result = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    lines = [line for line in result.stderr.splitlines() if "real_accelerator.py" not in line]
    return result.returncode, lines


@pytest.mark.parametrize("case, content, message", [
    ("missing", None, "--data {path}: no such file or folder"),
    ("empty", "", "--data {path} is empty; it needs at least one record"),
    ("fields", '{"body": "x"}\n', "--data {path}: line 1 has fields ['body']; expected 'text', or 'prompt' and "
                                  "'completion'"),
    ("too-long", json.dumps({"prompt": "p" * 100, "completion": "c"}) + "\n",
     "--data {path}: line 1 has 102 tokens (prompt + completion + eos), longer than --seq-len 64"),
])
def test_finetune_bad_data_is_one_line(tmp_path, tiny, case, content, message):
    path = tmp_path / f"{case}.jsonl"
    if content is not None:
        path.write_text(content)
    code, lines = _stderr_lines([sys.executable, str(FINETUNE), "--model", str(tiny), "--data", str(path),
                                 "--output-dir", str(tmp_path / "out"), "--seq-len", "64"])
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("finetune: error: " + message.format(path=path))


def test_memkit_train_checks_before_launching(tmp_path, tiny):
    code, lines = _stderr_lines([sys.executable, "-m", "memkit.cli.main", "train", "--model", str(tiny),
                                 "--data", str(TEXT_DATA), "--output-dir", str(tmp_path), "--seq-len", "512"])
    assert code == 2
    assert lines == ["memkit: error: --seq-len 512 is longer than the model allows (max_position_embeddings=256); "
                     "use --seq-len <= 256"]
