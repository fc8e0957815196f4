"""One HF-config builder (spec/hf_config.py) and one plan.json reader (emit/plan_doc.py), each
caller keeping its own one-line error (memkit/ARCHITECTURE.md, "One fact, one place")."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from memkit.calibrate.cpu_step import build_config as measured_config  # noqa: E402
from memkit.emit.plan_doc import read_plan_fields  # noqa: E402
from memkit.errors import MemkitError  # noqa: E402
from memkit.plan.plan import TrainingPlan  # noqa: E402
from memkit.spec.resolve import resolve_model  # noqa: E402
from memkit.estimate.traced import build_config as traced_config  # noqa: E402
from memkit.train.model import load_config  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}


def test_every_caller_builds_the_same_config(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    built = [traced_config(dict(TINY)), measured_config(dict(TINY)), load_config(resolve_model(str(folder)))]
    assert {type(c).__name__ for c in built} == {"LlamaConfig"}
    assert {(c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.vocab_size) for c in built} == {(64, 2, 2, 300)}


def test_the_runner_keeps_its_one_line_errors(tmp_path):
    folder = tmp_path / "odd{name}"  # braces in the path stay text, not a format field
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY, "hidden_size": "wide"}))
    with pytest.raises(MemkitError, match=r"odd\{name\}/config.json: transformers cannot build model_type 'llama' "
                                          r"\(.*hidden_size.*\)$") as err:
        load_config(resolve_model(str(folder)))
    assert "\n" not in str(err.value)
    path.write_text(json.dumps({k: v for k, v in TINY.items() if k != "model_type"}))
    with pytest.raises(MemkitError, match=r"odd\{name\}/config.json has no 'model_type'; is it a transformers "
                                          r"config.json\?$"):
        load_config(resolve_model(str(folder)))


def test_the_traced_and_measured_errors_are_theirs():
    with pytest.raises(MemkitError, match=r"^transformers cannot build model_type 'no-such-type' \(.*\); upgrade "
                                          r"transformers or pass a config of a model type it knows$"):
        traced_config({"model_type": "no-such-type"})
    with pytest.raises(MemkitError, match=r"^model config has no 'model_type'; add e.g. \"model_type\": \"llama\"$"):
        measured_config({"hidden_size": 64})


def test_plan_fields_of_a_bundle_and_of_a_bare_plan(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"tp": 2, "precision": "fp32"}))
    assert read_plan_fields(bare) == {"tp": 2, "precision": "fp32"}
    bundle = tmp_path / "run"
    bundle.mkdir()
    plan = TrainingPlan(precision="fp32", micro_batch_size=2, seq_len=64)
    (bundle / "plan.json").write_text(json.dumps({"plan": plan.to_dict()}))
    fields = read_plan_fields(bundle)  # a folder: its plan.json
    assert TrainingPlan.from_dict(fields) == plan
    broken = tmp_path / "broken.json"
    broken.write_text('{"plan": ')
    with pytest.raises(MemkitError, match=r"^--plan .*broken.json") as err:
        read_plan_fields(broken)
    assert "\n" not in str(err.value)
