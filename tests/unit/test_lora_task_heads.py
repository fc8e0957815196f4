"""LoRA on a task model (issue 27): one peft config for the runner, the CPU measurement, the trace and
the bundle, whose task_type follows the model (a classifier's SEQ_CLS / TOKEN_CLS, an encoder-decoder's
SEQ_2_SEQ_LM); under SEQ_CLS / TOKEN_CLS peft trains a full copy of the classifier head
(ModulesToSaveWrapper), which the estimate counts exactly. Measured peaks of these plans:
tests/unit/test_estimate_measured_arch.py (the *-lora8-seqcls3 / -tokcls5 rows)."""
from __future__ import annotations

import json

import pytest

from memkit.emit.trainer import lora_config
from memkit.plan.plan import TrainingPlan

H = 64
CONFIGS = {
    "bert": ({"model_type": "bert", "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 128}, ("query", "value")),
    "distilbert": ({"model_type": "distilbert", "dim": H, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                    "vocab_size": 500, "max_position_embeddings": 128}, ("q_lin", "v_lin")),
    "electra": ({"model_type": "electra", "hidden_size": H, "embedding_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 500,
                 "max_position_embeddings": 128}, ("query", "value")),
}
# The head modules peft copies, by hand from the modeling files (weights + biases):
# bert/modeling_bert.py BertForSequenceClassification / BertForTokenClassification: classifier h x L;
# distilbert/modeling_distilbert.py DistilBertForSequenceClassification: pre_classifier h x h and classifier
# h x L (its name ends in "classifier"); DistilBertForTokenClassification: classifier only;
# electra/modeling_electra.py ElectraClassificationHead (named classifier): dense h x h, out_proj h x L.
SAVED = {("bert", "seq-cls"): lambda n: H * n + n, ("bert", "token-cls"): lambda n: H * n + n,
         ("distilbert", "seq-cls"): lambda n: H * H + H + H * n + n, ("distilbert", "token-cls"): lambda n: H * n + n,
         ("electra", "seq-cls"): lambda n: H * H + H + H * n + n, ("electra", "token-cls"): lambda n: H * n + n}


def test_task_type_follows_the_model():
    lora = TrainingPlan(lora_rank=8)
    assert lora_config(lora)["task_type"] == "CAUSAL_LM"
    assert lora_config(lora, model_class="AutoModelForSeq2SeqLM")["task_type"] == "SEQ_2_SEQ_LM"
    assert lora_config(lora, model_class="AutoModelForMaskedLM")["task_type"] is None  # peft's plain PeftModel
    assert lora_config(lora.with_(task="seq-cls"))["task_type"] == "SEQ_CLS"
    assert lora_config(lora.with_(task="token-cls", num_labels=5))["task_type"] == "TOKEN_CLS"
    assert lora_config(TrainingPlan(task="seq-cls")) is None


@pytest.mark.parametrize("arch, task", sorted(SAVED), ids=[f"{a}-{t}" for a, t in sorted(SAVED)])
def test_trainable_count_is_peft_count_with_the_head_copy(arch, task):
    """peft's trainable parameters on the model the runner builds (meta device), under the runner's
    config, equal the estimate's: LoRA's r*(in+out) per target plus the copied head (hand-counted)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from memkit.estimate.memory import estimate_memory
    from memkit.spec.generic import task_spec
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config
    from memkit.spec.hf_config import TASK_CLASSES, build_config

    config, targets = CONFIGS[arch]
    plan = TrainingPlan(task=task, num_labels=3, lora_rank=4, lora_targets=targets, seq_len=64, micro_batch_size=2)
    hf_config = build_config({**config, "num_labels": 3})
    with torch.device("meta"):
        model = getattr(transformers, TASK_CLASSES[task]).from_config(hf_config)
        model = get_peft_model(model, LoraConfig(**lora_config(plan)))
    assert type(model).__name__ == {"seq-cls": "PeftModelForSequenceClassification",
                                    "token-cls": "PeftModelForTokenClassification"}[task]
    peft_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    spec = task_spec(spec_from_config(config, name=arch), plan)
    assert spec.lora_saved_params == SAVED[arch, task](3)
    lora = spec.lora_params(4, targets)
    assert peft_trainable == lora + SAVED[arch, task](3)
    est = estimate_memory(spec, plan, Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1), device="cpu")
    assert est.num_trainable_params == peft_trainable
    # the copy is held beside the frozen original (peft/utils/other.py ModulesToSaveWrapper.update)
    assert est.num_params == sum(p.numel() for p in model.parameters())


def test_bundle_writes_the_task_type_and_class(tmp_path):
    """A LoRA seq-cls plan's bundle: adapter_config.json's task_type is SEQ_CLS, plan.json names the
    class, and the README builds it with num_labels; peft reads the file back into the classifier's
    PeftModel."""
    from peft import LoraConfig

    from memkit.emit import plan_doc
    from memkit.emit.bundle import bundle_files
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.spec.generic import task_spec
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config
    from memkit.spec.hf_config import task_class

    config, targets = CONFIGS["bert"]
    plan = TrainingPlan(task="seq-cls", num_labels=3, lora_rank=4, lora_targets=targets, seq_len=64,
                        micro_batch_size=2)
    base = spec_from_config(config, name="tiny-bert")
    spec = task_spec(base, plan)
    hardware = Hardware(gpu=find_gpu("a100-80gb"))
    doc = plan_doc.plan_document(model_name="tiny-bert", plan=plan, hardware=plan_doc.hardware_dict(hardware),
                                 memory=estimate_memory(spec, plan, hardware),
                                 speed=estimate_step_time(spec, plan, hardware), version_info={"memkit": "test"},
                                 model_class=task_class(plan.task, base.auto_class))
    assert doc["model_class"] == "AutoModelForSequenceClassification"
    files = bundle_files(doc, out_dir=str(tmp_path))
    adapter = json.loads(files["adapter_config.json"])
    assert adapter["task_type"] == "SEQ_CLS"
    (tmp_path / "adapter_config.json").write_text(files["adapter_config.json"])
    assert LoraConfig.from_pretrained(str(tmp_path)).task_type == "SEQ_CLS"
    assert "AutoModelForSequenceClassification.from_pretrained('tiny-bert', attn_implementation='sdpa', " \
           "num_labels=3)" in files["README.md"]
    # BART as its seq2seq LM: --task causal-lm on an encoder-decoder
    assert task_class("causal-lm", "AutoModelForSeq2SeqLM") == "AutoModelForSeq2SeqLM"
    assert lora_config(plan.with_(task="causal-lm"), model_class="AutoModelForSeq2SeqLM")["task_type"] == "SEQ_2_SEQ_LM"


def test_default_targets_are_a_linear_peft_wraps():
    """Mamba has no q/v projections: the default is its first block nn.Linear (in_proj), not the
    conv1d.weight parameter listed before it, which peft refuses (one-line error before this)."""
    from memkit.planner.space import default_lora_targets
    from memkit.spec.hf import spec_from_config

    mamba = spec_from_config({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8,
                              "expand": 2, "conv_kernel": 4, "vocab_size": 500}, name="mamba")
    assert "conv1d.weight" in mamba.linear_names()
    assert default_lora_targets(mamba) == ("in_proj",)
