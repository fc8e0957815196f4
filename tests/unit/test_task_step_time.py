"""Step-time FLOPs of the task heads and of an encoder-decoder at two lengths (issue 27), hand-worked
from the modeling files' matmuls (estimate/throughput.py flops_per_token, _head_pass): a sequence
classifier of an encoder pools one position and runs its pooler and classifier once per sequence, a
token classifier runs its classifier on every position, a decoder's sequence classifier scores every
position; an encoder-decoder's decoder runs at --target-len with cross-attention over --seq-len."""
from __future__ import annotations

import pytest

from memkit.estimate.throughput import _head_rows, estimate_step_time, flops_per_token
from memkit.plan.plan import TrainingPlan
from memkit.spec.generic import task_spec
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import spec_from_config

H, S = 64, 64
BERT = {"model_type": "bert", "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 128}
BART = {"model_type": "bart", "d_model": H, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 100,
        "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
        "decoder_start_token_id": 2}
LLAMA = {"model_type": "llama", "hidden_size": H, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, "max_position_embeddings": 128}


def test_seq_cls_pools_one_position_token_cls_classifies_every_one():
    """bert/modeling_bert.py: BertForSequenceClassification runs BertPooler (dense h x h + bias) on
    hidden_states[:, 0] and the classifier (h x 3 + 3) on that: (4160 + 195) / S matmul parameters per
    position; BertForTokenClassification has no pooler and runs the classifier on every position: 195.
    6 FLOPs per matmul parameter per position (forward, input and weight gradients); all else equal."""
    seq = flops_per_token(spec_from_config(BERT, name="bert"), TrainingPlan(seq_len=S, task="seq-cls", num_labels=3))
    tok = flops_per_token(spec_from_config(BERT, name="bert"), TrainingPlan(seq_len=S, task="token-cls", num_labels=3))
    assert tok[0] - seq[0] == pytest.approx(6 * (195 - (H * H + H + 195) / S), rel=1e-12)
    spec = task_spec(spec_from_config(BERT, name="bert"), TrainingPlan(task="seq-cls", num_labels=3))
    assert spec.head_matmul_params == H * H + H + H * 3 + 3


def test_decoder_seq_cls_scores_every_position():
    """transformers/modeling_layers.py GenericForSequenceClassification.forward: `logits =
    self.score(hidden_states)` on every position, then the last non-pad one is gathered."""
    plan = TrainingPlan(seq_len=S, micro_batch_size=2, task="seq-cls", num_labels=3)
    llama = task_spec(spec_from_config(LLAMA, name="llama"), plan)
    bert = task_spec(spec_from_config(BERT, name="bert"), plan)
    assert _head_rows(llama, plan, 2 * S) == 2 * S and _head_rows(bert, plan, 2 * S) == 2
    assert llama.head_matmul_params == H * 3  # score, bias=False


def test_encoder_decoder_decoder_runs_at_target_len():
    """BART, one encoder and one decoder layer, seq_len 64, --target-len 16 against 64. Per input
    position the decoder's matmuls (self-attention q,k,v,out 4 x (64*64 + 64), its norm 128,
    cross-attention q, out 2 x 4160 and norm 128, fc1 64*128 + 128, fc2 128*64 + 64, final norm 128:
    50240 - the cross K/V 2 x 4160 = 41920) and the tied LM head (100 x 64) run t/s as often; the
    cross K/V run on the encoder's 64 positions either way (bart/modeling_bart.py BartAttention
    with key_value_states). Attention: self t x t and cross t x s per sequence, 12 x width each."""
    spec = spec_from_config(BART, name="bart")
    assert spec.layer_params == 50240
    full = flops_per_token(spec, TrainingPlan(seq_len=S))[0]
    short = flops_per_token(spec, TrainingPlan(seq_len=S, target_len=16))[0]
    dense = 6 * (41920 + 100 * H) * (1 - 16 / S)
    attention = 12 * H * ((S * S + S * S) - (16 * 16 + 16 * S)) / S
    assert full - short == pytest.approx(dense + attention, rel=1e-12)


def test_step_time_follows_the_head():
    """A 4096-wide decoder: its seq-cls head (score, 4096 x 2) against its LM head (4096 x 128256)
    -- the LM head's GEMMs and its cross-entropy over 128256 logits per token are gone."""
    big = {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192}
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    spec = spec_from_config(big, name="big")
    lm = estimate_step_time(spec, TrainingPlan(seq_len=4096, micro_batch_size=1), hw)
    cls = estimate_step_time(spec, TrainingPlan(seq_len=4096, micro_batch_size=1, task="seq-cls"), hw)
    assert cls.step_time_s < lm.step_time_s
    assert lm.model_flops_per_step - cls.model_flops_per_step == pytest.approx(
        6 * 4096 * (128256 * 4096 - 2 * 4096), rel=1e-9)
