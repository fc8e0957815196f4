"""A final model that cannot be written (read-only or full output folder) is one line and exit
EXIT_CHECKPOINT_WRITE, never exit 0 (issue #25): memkit.train.checkpoint.save_final_model run by a
real one-process Accelerator on a real tiny Llama, onto a real read-only tmpfs."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from memkit.train.checkpoint import EXIT_CHECKPOINT_WRITE

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from accelerate import Accelerator
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    from memkit.train.checkpoint import save_final_model

    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1},
                                                                                     unk_token="<unk>")))
    model = accelerator.prepare(model)
    save_final_model(accelerator, model, tokenizer, out / "final", lora_scaling=None)
    print("saved")
""")


def _save(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a real one-process Accelerator, model and save: 22.6 CPU s measured
def test_final_model_onto_a_read_only_folder_is_one_line_and_a_nonzero_exit(tmp_path):
    from tmpfs_util import remount_read_only, tmpfs

    with tmpfs(tmp_path / "out", "4m") as out:
        done = _save(out)  # it fits: the control
        assert done.returncode == 0, done.stderr
        assert (out / "final" / "model.safetensors").is_file()
        remount_read_only(out)
        done = _save(out)
        lines = [line for line in done.stderr.splitlines() if line.startswith("memkit:")]
        assert done.returncode == EXIT_CHECKPOINT_WRITE
        assert "saved" not in done.stdout
        assert lines == [f"memkit: could not write the final model to {out / 'final'}: read-only file system "
                         "(the run's checkpoints are kept; free space or fix the folder's permissions, then --resume)"]
        assert "Traceback" not in done.stderr
