"""`memkit suggest` and `memkit explain`: outputs, the files written, exit codes 0 / 2 / 3."""
from __future__ import annotations

import json

import pytest

from memkit.cli.main import main
from memkit.plan.plan import TrainingPlan

BASE = ["suggest", "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--num-gpus", "2",
        "--global-batch-size", "64", "--seq-len", "2048"]


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_shows_the_plan_its_peak_speed_and_why(capsys):
    code, out, err = run_cli(BASE, capsys)
    assert code == 0 and err == ""
    for text in ("Chosen plan: ZeRO-", "peak per GPU", "budget             21.6 GiB (10% headroom)", "tokens/s",
                 "s/step", "MFU", "Why not a faster plan:", "GiB > 21.6 GiB budget", "Alternatives that fit:"):
        assert text in out, text


def test_json_is_one_object_with_the_plan_document(capsys):
    code, out, _ = run_cli(BASE + ["--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["model"] == "llama-3.1-8b" and doc["hardware"]["gpu"] == "rtx-4090"
    plan = TrainingPlan.from_dict(doc["plan"])
    assert plan.global_batch_size == 64 and plan.dp == 2
    assert doc["estimate"]["nvidia_smi_peak_bytes"] <= doc["budget_bytes"]
    assert doc["step_time"]["tokens_per_s"] > 0 and 0 < doc["step_time"]["mfu"] < 1
    assert doc["rejected"] and all("budget" in r["reason"] or "host RAM" in r["reason"] for r in doc["rejected"])
    assert doc["alternatives"] and doc["request"]["global_batch_size"] == 64


def test_out_writes_the_bundle_and_explain_reads_it_back(tmp_path, capsys):
    out_dir = tmp_path / "run8b"
    code, out, _ = run_cli(BASE + ["--out", str(out_dir), "--plot", str(tmp_path / "mem.png")], capsys)
    assert code == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["README.md", "accelerate.yaml", "ds_config.json", "plan.json"]
    doc = json.loads((out_dir / "plan.json").read_text())
    assert set(doc["versions"]) >= {"memkit", "deepspeed", "accelerate", "torch"}
    assert doc["versions"]["deepspeed"] and doc["versions"]["torch"]
    ds = json.loads((out_dir / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == doc["plan"]["micro_batch_size"]
    assert ds["zero_optimization"]["stage"] == doc["plan"]["zero_stage"]
    command = (f"accelerate launch --config_file {out_dir}/accelerate.yaml -m memkit.finetune "
               f"--plan {out_dir}/plan.json --model meta-llama/Llama-3.1-8B")  # the weights, not the catalog config
    assert command in (out_dir / "README.md").read_text()  # the raw line stays in the README
    printed = (f"memkit train --plan {out_dir}/plan.json --model meta-llama/Llama-3.1-8B --data train.jsonl "
               f"--output-dir {out_dir}/run --main-process-port 29500")  # what is printed: the checked path
    assert printed in (out_dir / "README.md").read_text() and printed in out
    assert "--init random --max-steps 20" in (out_dir / "README.md").read_text()  # the smoke test says so
    assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code, shown, _ = run_cli(["explain", str(out_dir / "plan.json"), "--check"], capsys)
    assert code == 0
    assert f"Chosen plan: {doc['label']}" in shown and "still fits the budget" in shown


@pytest.mark.parametrize("extra, message", [
    (["--zero", "0", "--offload-optimizer", "cpu"], r"--offload-optimizer cpu needs ZeRO; use --zero 1, 2 or 3"),
    (["--global-batch-size", "63", "--tp", "1", "--pp", "1"],
     r"--global-batch-size 63 cannot be met exactly.*nearby achievable global batches: 62, 64"),
    (["--no-offload", "--offload-params", "cpu"], r"--offload-params cpu contradicts --no-offload"),
    (["--headroom", "lots"], r"--headroom 'lots' is not a number"),
    (["--tp", "two"], r"--tp 'two' must be a positive integer or 'auto'"),
    (["--lora-rank", "8", "--lora-targets", "nope"], r"--lora-targets nope not in llama-3.1-8b's linears"),
    (["--gpu", "rtx-5090x"], r"unknown GPU 'rtx-5090x'"),
    (["--model", "llama-3.1-9b"], r"unknown model 'llama-3.1-9b' \(did you mean"),
])
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys):
    code, out, err = run_cli(BASE + extra, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("memkit: error: ")
    import re

    assert re.search(message, err), err


def test_no_plan_fits_is_exit_3_with_nearest_misses(capsys):
    code, out, err = run_cli(["suggest", "--model", "llama-3.1-70b", "--gpu", "rtx-4090", "--global-batch-size", "8",
                              "--seq-len", "4096", "--no-offload"], capsys)
    assert code == 3
    assert "No plan fits llama-3.1-70b on 1 x rtx-4090" in out and "what it would need" in out
    assert "a GPU with >=" in out
    assert err.count("\n") == 1 and err.startswith("memkit: error: no plan fits")


def test_no_plan_fits_json(capsys):
    code, out, _ = run_cli(["suggest", "--model", "llama-3.1-70b", "--gpu", "rtx-4090", "--global-batch-size", "8",
                            "--no-offload", "--json"], capsys)
    assert code == 3
    doc = json.loads(out)
    assert doc["nearest_misses"] and all(m["needs"] for m in doc["nearest_misses"])


def test_explain_rejects_what_is_not_a_plan(tmp_path, capsys):
    bogus = tmp_path / "plan.json"
    bogus.write_text(json.dumps({"hello": 1}))
    code, _, err = run_cli(["explain", str(bogus)], capsys)
    assert code == 2 and "not a memkit plan.json" in err
    code, _, err = run_cli(["explain", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "no such file" in err


def test_explain_check_reprices_the_stack_the_plan_was_priced_for(tmp_path, capsys):
    # transformers < 4.46 shifts a contiguous copy of the logits (spec/stack.py): plan.json records
    # the stack, and `explain --check` must price that stack again, not the installed one
    out_dir = tmp_path / "old"
    args = ["suggest", "--model", "llama-3.2-1b", "--gpu", "a100-80gb", "--global-batch-size", "8",
            "--seq-len", "2048", "--stack", "transformers=4.40", "--out", str(out_dir), "--json"]
    code, _, _ = run_cli(args, capsys)
    assert code == 0
    doc = json.loads((out_dir / "plan.json").read_text())
    assert doc["stack"]["transformers"] == "4.40"
    code, shown, _ = run_cli(["explain", str(out_dir / "plan.json"), "--check", "--json"], capsys)
    assert code == 0
    check = json.loads(shown)["check"]
    assert check["estimate"]["allocated_peak_bytes"] == doc["estimate"]["allocated_peak_bytes"]
    # without the record the installed stack is priced, which has no shifted copy
    plain = dict(doc)
    del plain["stack"]
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    code, shown, _ = run_cli(["explain", str(tmp_path / "plain.json"), "--check", "--json"], capsys)
    assert code == 0
    assert json.loads(shown)["check"]["estimate"]["allocated_peak_bytes"] < doc["estimate"]["allocated_peak_bytes"]
    # a malformed record is one line of bad input
    (tmp_path / "bad.json").write_text(json.dumps({**doc, "stack": {"torch": 2}}))
    assert main(["explain", str(tmp_path / "bad.json"), "--check"]) == 2
    assert "plan.json 'stack'" in capsys.readouterr().err


def test_suggest_prices_step_time_for_the_stack_it_is_given(capsys):
    # issue 21 item 4: --stack reaches the step-time model, not only memory. DeepSpeed < 0.9.4
    # builds ZeRO-3's fetch/release debug strings with logging off (throughput.py
    # ZERO3_DEBUG_CALLS_PER_PARAM, deepspeedai/DeepSpeed#3622), so a ZeRO-3 plan priced for 0.9.0
    # carries that host overhead and plan.json's step time is estimate_step_time's for that stack.
    from memkit.estimate.throughput import estimate_step_time
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec
    from memkit.spec.stack import parse_stack
    argv = ["suggest", "--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--num-gpus", "8",
            "--global-batch-size", "64", "--seq-len", "2048", "--zero", "3", "--json"]
    code, out, _ = run_cli(argv + ["--stack", "deepspeed=0.9.0"], capsys)
    assert code == 0
    doc = json.loads(out)
    plan = TrainingPlan.from_dict(doc["plan"])
    assert plan.engine == "deepspeed" and plan.zero_stage == 3
    hw = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=8)
    model = load_model_spec("llama-3.1-8b")
    old = estimate_step_time(model, plan, hw, stack=parse_stack("deepspeed=0.9.0"))
    installed = estimate_step_time(model, plan, hw)
    assert doc["step_time"]["step_time_s"] == pytest.approx(old.step_time_s, rel=1e-9)
    assert old.components_s["host_overhead"] > installed.components_s["host_overhead"]
