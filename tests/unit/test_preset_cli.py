"""Presets launched from anywhere (#15): `memkit preset NAME --out DIR` writes the preset's plan with
absolute paths (the same DeepSpeed file and plan, byte for byte), and `memkit train` / `verify`
resolve a preset's repository-relative DeepSpeed path beside its accelerate.yaml."""
from __future__ import annotations

import pytest
import yaml

from memkit.cli.main import main
from memkit.presets_dir import presets_dir

PLANS = presets_dir() / "plans"
NAMES = sorted(p.name for p in PLANS.iterdir()) if PLANS.is_dir() else []


@pytest.mark.parametrize("name", NAMES)
def test_preset_bundle_is_the_preset_with_absolute_paths(name, tmp_path):
    from memkit.cli.preset import preset_bundle

    out = str(tmp_path / "b")
    files = preset_bundle(name, out)
    committed = {p.name: p.read_text() for p in (PLANS / name).iterdir()}
    assert set(files) == set(committed) | {"README.md"}
    for fname in set(committed) - {"accelerate.yaml"}:
        assert files[fname] == committed[fname], fname
    ours, theirs = yaml.safe_load(files["accelerate.yaml"]), yaml.safe_load(committed["accelerate.yaml"])
    if "deepspeed_config" in theirs:
        assert theirs["deepspeed_config"]["deepspeed_config_file"] == f"presets/plans/{name}/ds_config.json"
        assert ours["deepspeed_config"].pop("deepspeed_config_file") == f"{out}/ds_config.json"
        theirs["deepspeed_config"].pop("deepspeed_config_file")
    assert ours == theirs
    assert f"--config_file {out}/accelerate.yaml -m memkit.finetune --plan {out}/plan.json" in files["README.md"]


def test_preset_lists_writes_and_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["preset"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line.split("  ")[0] for line in table[2:2 + len(NAMES)]]
    assert rows == NAMES  # every preset, in name order, under a header and a rule
    assert table[0].split() == ["preset", "model", "GPUs", "plan", "peak", "GiB", "tokens/s"]
    name = "llama-3.2-1b-full-1xh100-80gb-4k"
    assert main(["preset", name, "--out", "here"]) == 0
    out = capsys.readouterr().out
    assert f"memkit train --plan {tmp_path / 'here' / 'plan.json'} --model meta-llama/Llama-3.2-1B" in out
    assert out.count("--main-process-port 29500") == 1
    assert f"--config_file {tmp_path / 'here' / 'accelerate.yaml'}" in (tmp_path / "here" / "README.md").read_text()
    assert yaml.safe_load((tmp_path / "here" / "accelerate.yaml").read_text())["deepspeed_config"][
        "deepspeed_config_file"] == str(tmp_path / "here" / "ds_config.json")
    assert main(["preset", "llama-3.2-1b-full-1xh100-80gb-4kk"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memkit: error: unknown preset 'llama-3.2-1b-full-1xh100-80gb-4kk' (did you mean") and \
        err.endswith("`memkit preset` lists them")


def test_a_relative_deepspeed_path_is_resolved_beside_the_yaml_from_any_directory(tmp_path, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from memkit.cli.launching import launchable_config
    from memkit.errors import MemkitError

    name = "llama-3.2-1b-full-1xh100-80gb-4k"
    preset_yaml = PLANS / name / "accelerate.yaml"
    monkeypatch.chdir(tmp_path)  # outside the repository: presets/plans/... does not exist from here
    with launchable_config(preset_yaml) as launched:
        assert launched != preset_yaml
        acc = yaml.safe_load(launched.read_text())
        assert acc["deepspeed_config"]["deepspeed_config_file"] == str(PLANS / name / "ds_config.json")
        args = launch_command_parser().parse_args(["--config_file", str(launched), "-m", "memkit.finetune"])
        assert _validate_launch_command(args)[0].deepspeed_config_file == str(PLANS / name / "ds_config.json")
    assert not launched.exists()  # the temporary copy is removed after the run
    broken = tmp_path / "accelerate.yaml"
    broken.write_text(preset_yaml.read_text())
    with pytest.raises(MemkitError, match=r"deepspeed_config_file presets/plans/.*/ds_config.json is neither under"):
        with launchable_config(broken):
            pass


def test_every_preset_lists_shows_and_writes(tmp_path, capsys, monkeypatch):
    """`memkit preset` rows, `memkit preset NAME` and `memkit preset NAME --out DIR` for all presets
    (#24): each row states the plan's own model, GPUs, label, peak and speed; each README is shown;
    each bundle is written with the committed plan.json byte for byte and prints its run command."""
    import json

    from memkit.units import GIB

    monkeypatch.chdir(tmp_path)
    assert main(["preset"]) == 0
    table = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert len(NAMES) == 133
    for name in NAMES:
        doc = json.loads((PLANS / name / "plan.json").read_text())
        hw = doc["hardware"]
        row = table[name]
        assert f"  {doc['model']}  " in row and f"  {hw['num_gpus_per_node']} x {hw['gpu']}  " in row
        assert f"  {doc['label']}  " in row
        assert row.split()[-4:] == [f"{doc['estimate']['nvidia_smi_peak_bytes'] / GIB:.1f}", "/",
                                    f"{hw['gpu_memory_bytes'] / GIB:.0f}", f"{doc['step_time']['tokens_per_s']:,.0f}"]
        assert main(["preset", name]) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"# {doc['model']} on ") and f"memkit train --plan presets/plans/{name}/plan.json" in shown
        out = tmp_path / name
        assert main(["preset", name, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert f"memkit train --plan {out}/plan.json " in printed and f"--output-dir {out}/run" in printed
        assert (out / "plan.json").read_text() == (PLANS / name / "plan.json").read_text()
        assert (out / "README.md").is_file() and (out / "accelerate.yaml").is_file()
