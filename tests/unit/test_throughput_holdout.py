"""The held-out throughput file (benchmarks/data/holdout_throughput.jsonl) maps onto memkit plans
with the knobs its sources state, and benchmarks/throughput_accuracy.py prints it as its own half."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLDOUT = ROOT / "benchmarks" / "data" / "holdout_throughput.jsonl"
sys.path.insert(0, str(ROOT / "benchmarks"))

from memkit.calibrate.published_throughput import map_record, score, summarize  # noqa: E402


def _records() -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, HOLDOUT.read_text().splitlines())}


def test_holdout_records_map_with_their_stated_knobs():
    recs = _records()
    assert len(recs) == 43 and {r["source_id"] for r in recs.values()} == {
        "torchtune_readme", "vectorlm_reference_throughput", "peft_method_comparison"}
    cfg = ROOT / "benchmarks" / "calibration_configs"
    lora = map_record(recs["torchtune-flags-3b-lora"], configs_dir=cfg)
    plan = lora.plans[0]
    # torchtune lora_attn_modules [q_proj, v_proj, output_proj] + apply_lora_to_mlp: 6 of 7 linears
    assert set(plan.lora_targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (plan.lora_rank, plan.lora_alpha, plan.lora_dropout) == (64, 128, 0.0)
    assert (plan.loss, plan.offload_activations, plan.checkpointing) == ("chunked", "cpu", "full")
    assert lora.offload_streams and lora.compiled and lora.lora_adapter_dtype == "bf16"
    vl = map_record(recs["vectorlm-lora-n4-s8192"], configs_dir=cfg)
    assert (vl.plans[0].dp, vl.plans[0].micro_batch_size, vl.plans[0].zero_stage, vl.plans[0].engine) == (4, 2, 3, "torch")
    assert vl.measured_tps_per_gpu == 12769.23 / 4 and vl.lora_adapter_dtype == "bf16"
    assert map_record(recs["torchtune-flags-3b-qlora"], configs_dir=cfg).skip_reason
    assert not map_record(recs["torchtune-flags-3b-baseline"], configs_dir=cfg).absolute   # unpacked
    # packed torchtune rows attend through FlexAttention's document BlockMask: marked approximate
    flex = "FlexAttention"
    assert any(flex in a for a in map_record(recs["torchtune-flags-3b-packed"], configs_dir=cfg).approx)
    assert any(flex in a for a in lora.approx)
    assert not any(flex in a for a in map_record(recs["torchtune-flags-3b-baseline"], configs_dir=cfg).approx)
    # torchtune's configs set no clip_grad_norm; its LoRA recipe builds AdamW(fused=True)
    assert lora.plans[0].gradient_clipping == 0.0 and lora.fused_optimizer
    # peft's MetaMathQA loop: fp32 adapters, clip 1.0, ranked only, grouped per stated stack
    pm = map_record(recs["peftmc-lora-rank32-torch2.9.0"], configs_dir=cfg)
    assert pm.lora_adapter_dtype == "fp32" and pm.plans[0].gradient_clipping == 1.0 and not pm.absolute
    assert pm.group != map_record(recs["peftmc-lora-rank32-torch2.13.0"], configs_dir=cfg).group
    assert pm.group == map_record(recs["peftmc-full-finetuning-torch2.9.0"], configs_dir=cfg).group
    assert (pm.plans[0].lora_rank, pm.plans[0].micro_batch_size, pm.plans[0].seq_len) == (32, 4, 210)


def test_throughput_accuracy_prints_the_dev_and_holdout_halves(capsys, tmp_path):
    import throughput_accuracy

    dev = tmp_path / "dev.jsonl"
    rows = [r for r in map(json.loads, HOLDOUT.read_text().splitlines()) if r["id"].startswith("vectorlm-full-n1")]
    dev.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert throughput_accuracy.main(["--data", str(dev), "--holdout", str(HOLDOUT)]) == 0
    out = capsys.readouterr().out
    first, second = out.split("== holdout:")
    assert "== dev:" in first and "vectorlm_reference_throughput" in first and "torchtune_readme" not in first
    assert "torchtune_readme" in second and "vectorlm_reference_throughput" in second
    table = summarize([score(map_record(r, configs_dir=ROOT / "benchmarks" / "calibration_configs"))
                       for r in map(json.loads, HOLDOUT.read_text().splitlines())])
    all_line = next(line for line in second.splitlines() if line.startswith("ALL"))
    assert f"{table['ALL']['concordant']:.1%}" in all_line and str(table["ALL"]["pairs"]) in all_line
