"""Measure real CPU training steps of the state-space, hybrid, encoder-decoder and encoder families
(issue #27), like benchmarks/measure_cpu.py and with its machinery, into their own golden file:

    python benchmarks/measure_cpu_arch.py --out tests/golden/cpu_measurements_arch.json
    python benchmarks/measure_cpu_arch.py --rows mamba-fp32-sdpa --out /tmp/x.json

Tiny random configs (hidden 256, 4 blocks, seq 256, micro 2) of jamba, mamba, bart, electra,
deberta-v2 and distilbert, each fp32 / bf16 autocast / bf16 with full checkpointing / LoRA, and
eager attention where the family has both kernels. Mamba and DeBERTa-v2 have no SDPA path in
transformers 5: their "sdpa" rows run eager (memkit/estimate/traced.py from_config), as memkit
prices them. benchmarks/arch_accuracy.py prints the estimate against these rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_cpu as base  # noqa: E402  (benchmarks/measure_cpu.py)
from measure_cpu import _single  # noqa: E402

_IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def arch_configs(*, hidden: int, layers: int, heads: int, ffn: int, jamba_ffn: int, vocab: int, positions: int,
                 d_state: int, buckets: int, bart_forced_eos: bool = True) -> dict[str, dict]:
    """Tiny random configs of the state-space, hybrid, encoder-decoder and encoder families, at
    the given sizes (this script's rows; tests/unit/test_traced_arch.py's smaller traces)."""
    return {
        # Jamba: attention every 2nd block (offset 1), MoE every 2nd block; the rest Mamba mixers.
        # CPU has no mamba_ssm / causal_conv1d: transformers runs JambaMambaMixer.slow_forward.
        "jamba": {"model_type": "jamba", "hidden_size": hidden, "intermediate_size": jamba_ffn,
                  "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 2,
                  "vocab_size": vocab, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                  "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": d_state,
                  "mamba_d_conv": 4, "mamba_expand": 2, **_IDS},
        "mamba": {"model_type": "mamba", "hidden_size": hidden, "num_hidden_layers": layers, "state_size": d_state,
                  "expand": 2, "conv_kernel": 4, "vocab_size": vocab, **_IDS},
        "bart": {"model_type": "bart", "d_model": hidden, "encoder_layers": 2, "decoder_layers": 2,
                 "encoder_attention_heads": heads, "decoder_attention_heads": heads, "encoder_ffn_dim": ffn,
                 "decoder_ffn_dim": ffn, "vocab_size": vocab, "max_position_embeddings": positions,
                 "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "decoder_start_token_id": 2,
                 **({"forced_eos_token_id": 2} if bart_forced_eos else {})},
        "electra": {"model_type": "electra", "hidden_size": hidden, "embedding_size": hidden // 2,
                    "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": ffn,
                    "vocab_size": vocab, "max_position_embeddings": positions},
        "deberta-v2": {"model_type": "deberta-v2", "hidden_size": hidden, "num_hidden_layers": layers,
                       "num_attention_heads": heads, "intermediate_size": ffn, "vocab_size": vocab,
                       "max_position_embeddings": positions, "relative_attention": True, "position_buckets": buckets,
                       "pos_att_type": ["p2c", "c2p"], "norm_rel_ebd": "layer_norm", "share_att_key": True,
                       "position_biased_input": False},
        "distilbert": {"model_type": "distilbert", "dim": hidden, "n_layers": layers, "n_heads": heads,
                       "hidden_dim": ffn, "vocab_size": vocab, "max_position_embeddings": positions},
    }


ARCHS = arch_configs(hidden=256, layers=4, heads=8, ffn=1024, jamba_ffn=688, vocab=2000, positions=512, d_state=16,
                     buckets=256)
# BERT (hand-modelled as a masked LM, spec/hf.py): only its classifiers are measured here (--task).
ARCHS["bert"] = {"model_type": "bert", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "intermediate_size": 1024, "vocab_size": 2000, "max_position_embeddings": 512}
# peft refuses out_proj and conv1d for model_type mamba (not for jamba).
LORA = {"jamba": ("q_proj", "v_proj", "in_proj", "out_proj"), "mamba": ("in_proj", "x_proj"),
        "bart": ("q_proj", "v_proj"), "electra": ("query", "value"), "deberta-v2": ("query_proj", "value_proj"),
        "distilbert": ("q_lin", "v_lin"), "bert": ("query", "value")}
EAGER_TOO = ("jamba", "bart", "electra", "distilbert")  # families with an SDPA path: an eager row as well
FAMILIES = tuple(a for a in ARCHS if a != "bert")
ROWS = [row for arch in FAMILIES for row in (
    _single(f"{arch}-fp32-sdpa", arch),
    _single(f"{arch}-bf16-sdpa", arch, precision="bf16"),
    _single(f"{arch}-bf16-sdpa-ckpt", arch, precision="bf16", checkpointing="full"),
    _single(f"{arch}-fp32-sdpa-lora8", arch, lora_rank=8, lora_targets=LORA[arch]),
    *([_single(f"{arch}-fp32-eager", arch, attention="eager")] if arch in EAGER_TOO else []))]
# Classification heads (--task seq-cls / token-cls, --num-labels) instead of the LM head, and an
# encoder-decoder's decoder at its own length (--target-len); T5 from measure_cpu.py's ARCHS.
ROWS += [
    _single("bert-fp32-sdpa-seqcls3", "bert", task="seq-cls", num_labels=3),
    _single("bert-bf16-sdpa-tokcls5", "bert", precision="bf16", task="token-cls", num_labels=5),
    _single("bert-bf16-sdpa-ckpt-seqcls3", "bert", precision="bf16", checkpointing="full", task="seq-cls",
            num_labels=3),
    _single("bert-fp32-sdpa-ckpt-tokcls5", "bert", checkpointing="full", task="token-cls", num_labels=5),
    _single("deberta-v2-fp32-sdpa-seqcls3", "deberta-v2", task="seq-cls", num_labels=3),
    _single("deberta-v2-bf16-sdpa-tokcls9", "deberta-v2", precision="bf16", task="token-cls", num_labels=9),
    _single("electra-fp32-sdpa-seqcls2", "electra", task="seq-cls"),
    _single("electra-fp32-eager-tokcls9", "electra", attention="eager", task="token-cls", num_labels=9),
    _single("distilbert-fp32-sdpa-seqcls2", "distilbert", task="seq-cls"),
    _single("distilbert-bf16-sdpa-ckpt-tokcls5", "distilbert", precision="bf16", checkpointing="full",
            task="token-cls", num_labels=5),
    _single("bart-fp32-sdpa-tgt64", "bart", target_len=64),
    _single("bart-bf16-sdpa-ckpt-tgt128", "bart", precision="bf16", checkpointing="full", target_len=128),
    _single("bart-fp32-eager-seq128-tgt256", "bart", attention="eager", seq_len=128, target_len=256),
    # micro 8: the activations, not the optimizer step, set the peak
    _single("bart-fp32-sdpa-micro8-tgt64", "bart", micro_batch_size=8, target_len=64),
    _single("bart-bf16-sdpa-micro8-seq64-tgt256", "bart", precision="bf16", micro_batch_size=8, seq_len=64,
            target_len=256),
    _single("t5-fp32-sdpa-tgt64", "t5", target_len=64),
    _single("t5-bf16-sdpa-ckpt-tgt128", "t5", precision="bf16", checkpointing="full", target_len=128),
]
# LoRA on the classifiers: peft's SEQ_CLS / TOKEN_CLS models also train a full copy of the head
# (memkit/spec/hf_config.py PEFT_SAVED_HEADS): DistilBERT's pre_classifier, ELECTRA's dense + out_proj.
# Not yet a golden row: bert fp32 + full checkpointing + LoRA token-cls measured 41.97 MiB against an
# estimate of 39.08 (-6.9 %; the same without LoRA +4.0 %, ELECTRA bf16 + checkpointing + LoRA -2.2 %).
ROWS += [_single(f"{arch}-{prec}-sdpa{ckpt}-lora8-{task}", arch, lora_rank=8, lora_targets=LORA[arch],
                 precision=prec, checkpointing="full" if ckpt else "none",
                 task={"seqcls3": "seq-cls", "tokcls5": "token-cls"}[task], num_labels=int(task[-1]))
         for arch, prec, ckpt, task in (
             ("bert", "fp32", "", "seqcls3"), ("bert", "bf16", "", "tokcls5"),
             ("deberta-v2", "fp32", "", "seqcls3"), ("deberta-v2", "bf16", "", "tokcls5"),
             ("distilbert", "fp32", "", "seqcls3"), ("distilbert", "fp32", "", "tokcls5"),
             ("electra", "fp32", "", "seqcls3"), ("electra", "bf16", "-ckpt", "tokcls5"))]


GOLDEN_DESCRIPTION = ("Peak live-tensor bytes of real CPU training steps of state-space, hybrid, encoder-decoder and "
                      "encoder families; generated by benchmarks/measure_cpu_arch.py")


def main(argv: list[str] | None = None) -> int:
    base.ARCHS.update(ARCHS)
    return base.single_rows_main(argv, ROWS, worker=Path(__file__), doc=__doc__, description=GOLDEN_DESCRIPTION)


if __name__ == "__main__":
    raise SystemExit(main())
