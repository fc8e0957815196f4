"""What users hand memkit and where it writes: a foreign --out folder is left byte-identical,
printed and written commands survive hostile paths, data as Windows editors and pipes give it,
and a write that fails (file-size limit, as a full disk) exits non-zero leaving no temporary file.

In-process (memkit.cli.main.main) except where a shell or a resource limit is the point.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from memkit.cli.main import main
from memkit.errors import MemkitError

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 256, "tie_word_embeddings": False}
HOSTILE = "my run $(touch PWNED1) `touch PWNED2` 'q' \"dq\" ; touch PWNED3 é東"
"""Spaces, both quotes, $( ), backticks, a ; and non-ASCII: each would run or split if pasted unquoted."""
REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture()
def tiny(tmp_path) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def _suggest(tiny: Path, out: Path, *extra: str) -> list[str]:
    return ["suggest", "--model", str(tiny), "--gpu", "a100-80gb", "--num-gpus", "2", "--seq-len", "64",
            "--global-batch-size", "8", "--zero", "2", "--out", str(out), *extra]


# ---- --out never replaces what memkit did not write ------------------------------------------------

def test_suggest_and_preset_out_into_a_foreign_folder_change_nothing(tiny, tmp_path, capsys):
    project = tmp_path / "my_project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("# my project\n")
    (project / "plan.json").write_text('{"mine": true}\n')  # a plan.json memkit did not write
    (project / "src" / "train.py").write_text("print('hi')\n")
    before = _tree(project)
    for argv in (_suggest(tiny, project), ["preset", "llama-3.2-1b-full-8xl40s-4k", "--out", str(project)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "memkit did not write" in err and "--force" in err, err
        assert _tree(project) == before
    assert main(_suggest(tiny, project, "--force")) == 0  # the user said so: bundle files written beside theirs
    assert (project / "src" / "train.py").read_text() == "print('hi')\n"
    assert json.loads((project / "plan.json").read_text())["format_version"] == 1


def test_out_into_an_empty_folder_or_a_memkit_bundle_is_allowed(tiny, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(_suggest(tiny, empty)) == 0
    (empty / "notes.txt").write_text("mine\n")  # the user's file inside a memkit bundle stays
    assert main(_suggest(tiny, empty)) == 0
    assert (empty / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in empty.iterdir()) == ["README.md", "accelerate.yaml", "ds_config.json",
                                                      "notes.txt", "plan.json"]


# ---- shell-safe commands ---------------------------------------------------------------------------

def _fake_bin(folder: Path, names: tuple[str, ...]) -> Path:
    """Executables that record their argv (one per line, NUL-free) instead of doing anything."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        script = folder / name
        script.write_text("#!/bin/bash\nprintf '%s\\n' \"$0\" \"$@\" >> \"$MEMKIT_TEST_ARGV\"\n")
        script.chmod(0o755)
    return folder


def _no_marker(root: Path) -> None:
    assert not [p for p in root.rglob("PWNED*")], "an embedded command ran"


def test_printed_and_written_commands_survive_a_hostile_path(tiny, tmp_path, capsys, monkeypatch):
    """The bundle, the launch script and the finetune arguments all under a path with spaces, quotes,
    $( ), backticks, ';' and non-ASCII: `bash -n` accepts the script, pasting the printed `memkit train`
    line, the bundle README's raw `accelerate launch` line and running the script pass each path as one
    argument, and no embedded command runs."""
    root = tmp_path / HOSTILE
    root.mkdir()
    monkeypatch.chdir(root)
    bundle = root / f"bundle {HOSTILE}"
    assert main(_suggest(tiny, bundle, "--num-gpus", "1")) == 0
    printed = capsys.readouterr().out
    readme = (bundle / "README.md").read_text()
    train_line = next(line.strip() for line in printed.splitlines() if line.strip().startswith("memkit train"))
    accelerate_line = next(line.strip() for line in readme.splitlines()
                           if line.strip().startswith("accelerate launch"))
    fake = _fake_bin(tmp_path / "bin", ("accelerate", "memkit", "sbatch", "srun"))
    (fake / "scontrol").write_text("#!/bin/bash\necho node1\n")  # `scontrol show hostnames`: the first node
    (fake / "scontrol").chmod(0o755)
    argv_log = tmp_path / "argv.txt"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "MEMKIT_TEST_ARGV": str(argv_log)}
    for line, first in ((train_line, "train"), (accelerate_line, "launch")):
        argv_log.unlink(missing_ok=True)
        assert subprocess.run(["bash", "-n", "-c", line]).returncode == 0
        subprocess.run(["bash", "-c", line], cwd=root, env=env, check=True)  # pasted as printed
        logged = argv_log.read_text().splitlines()
        assert logged[1] == first, logged
        assert logged[logged.index("--plan") + 1] == f"{bundle}/plan.json"
        assert logged[logged.index("--model") + 1] == str(tiny)
        assert logged[logged.index("--output-dir") + 1] == f"{bundle}/run"
    assert logged[logged.index("--config_file") + 1] == f"{bundle}/accelerate.yaml"
    assert shlex.quote(f"{bundle}/plan.json") in readme

    out = root / f"run {HOSTILE}.sh"
    output_dir = f"out {HOSTILE}"
    assert main(["launch-script", "--plan", str(bundle / "plan.json"), "--slurm", "--out", str(out), "--",
                 "--data", "synthetic", "--output-dir", output_dir]) == 0
    printed = capsys.readouterr().out
    command = printed.split("start it with `", 1)[1].rsplit("`", 1)[0]
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    argv_log.unlink()
    subprocess.run(["bash", "-c", command], cwd=root, env=env, check=True)  # pasted: sbatch gets the path
    assert argv_log.read_text().splitlines()[1:] == [str(out)]
    argv_log.unlink()
    env_run = {**env, "SLURM_JOB_NODELIST": "node1", "SLURM_CPUS_ON_NODE": "4"}
    subprocess.run(["bash", str(out)], cwd=tmp_path, env=env_run, check=True)  # srun gets the exact arguments
    srun = argv_log.read_text().splitlines()
    assert srun[0].endswith("/srun") and srun[-3:] == ["--output-dir", output_dir, "--resume"]  # Slurm: resumes
    assert f"--config_file {shlex.quote(str(bundle / 'accelerate.yaml'))}" in srun[srun.index("-c") + 1]
    _no_marker(tmp_path)


def test_hostfile_script_runs_the_node_line_with_hostile_values(tiny, tmp_path, capsys, monkeypatch):
    """`MACHINE_RANK=0 bash run.sh --node` with a hostile working folder, config path and arguments:
    the launcher (a fake python) receives each one intact; nothing embedded runs."""
    root = tmp_path / HOSTILE
    root.mkdir()
    monkeypatch.chdir(root)
    bundle = root / "bundle"
    assert main(_suggest(tiny, bundle, "--num-gpus", "1")) == 0
    hosts = root / "hosts"
    hosts.write_text("node-01 slots=1\n")
    fake = _fake_bin(tmp_path / "bin", ("python",))
    out = root / "run.sh"
    assert main(["launch-script", "--plan", str(bundle / "plan.json"), "--hostfile", str(hosts), "--out", str(out),
                 "--python", str(fake / "python"), "--", "--data", "synthetic", "--output-dir", HOSTILE]) == 0
    capsys.readouterr()
    argv_log = tmp_path / "argv.txt"
    env = {**os.environ, "MEMKIT_TEST_ARGV": str(argv_log), "MACHINE_RANK": "0", "MEMKIT_RUN_ID": "t"}
    subprocess.run(["bash", str(out), "--node"], cwd=tmp_path, env=env, check=True)
    logged = argv_log.read_text().splitlines()
    assert logged[logged.index("--config_file") + 1] == str(bundle / "accelerate.yaml")
    assert logged[-2:] == ["--output-dir", HOSTILE] and logged[logged.index("--main_process_ip") + 1] == "node-01"
    _no_marker(tmp_path)
    Path("/tmp/memkit-t.rank0.pid").unlink(missing_ok=True)


@pytest.mark.parametrize("host", ["n$(touch${IFS}PWNED)", "a;b", "-rf", "node_1", "a" * 64 + ".x", "x..y", ""])
def test_hostile_host_names_are_refused(host, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(_suggest(tiny, tmp_path / "b", "--num-gpus", "1")) == 0
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{host} slots=1\n" if host else "# none\n")
    capsys.readouterr()
    code = main(["launch-script", "--plan", str(tmp_path / "b" / "plan.json"), "--hostfile", str(hosts),
                 "--out", str(tmp_path / "run.sh")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "run.sh").exists(), err
    assert main(_suggest(tiny, tmp_path / "c", f"--main-process-ip={host or ' '}")) == 2
    assert "--main-process-ip" in capsys.readouterr().err
    _no_marker(tmp_path)


@pytest.mark.parametrize("host", ["node-01", "10.0.0.1", "fe80::1", "gpu7.cluster.example.org", "N1."])
def test_valid_host_names_are_accepted(host):
    from memkit.validate import check_host

    assert check_host(host, what="--main-process-ip") == host


# ---- data like users have it -------------------------------------------------------------------------

def test_bom_and_crlf_read_as_plain_utf8(tmp_path):
    from memkit.train.records import read_records

    plain, windows = tmp_path / "plain.jsonl", tmp_path / "windows.jsonl"
    plain.write_text(json.dumps({"text": "héllo wörld"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    windows.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n"))
    assert [r["text"] for r in read_records(str(windows))[1]] == [r["text"] for r in read_records(str(plain))[1]]
    text = tmp_path / "doc.txt"
    text.write_bytes(b"\xef\xbb\xbfFirst doc\r\n\r\nSecond doc\r\n")
    assert [r["text"] for r in read_records(str(text))[1]] == ["First doc", "Second doc"]


def test_fifo_and_device_are_refused_before_opening(tmp_path):
    """A FIFO would block the reader forever: refused from its type, in a thread that must end."""
    from memkit.validate import check_data

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    errors = []

    def probe(source):
        try:
            check_data(source, seq_len=64)
        except MemkitError as exc:
            errors.append(str(exc))

    for source in (str(fifo), "/dev/zero"):
        thread = threading.Thread(target=probe, args=(source,), daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), f"{source} blocked the check"
    assert "FIFO" in errors[0] and "character device" in errors[1], errors
    from memkit.train.records import read_records

    with pytest.raises(MemkitError, match="FIFO"):
        read_records(str(fifo))


def test_damaged_datasets_folder_and_csv_are_one_line(tmp_path):
    import datasets

    from memkit.train.records import read_records

    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(folder))
    (folder / "state.json").write_text("{")
    with pytest.raises(MemkitError, match=r"cannot read it as a datasets folder \(JSONDecodeError") as info:
        read_records(str(folder))
    assert "\n" not in str(info.value)
    ints = tmp_path / "ints"
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(ints))
    with pytest.raises(MemkitError, match=r"row 0: 'text' is a int"):
        read_records(str(ints))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("text,x\nhello,1\nbad,2,3,4\n")
    with pytest.raises(MemkitError, match=r"Expected 2 fields in line 3, saw 4"):
        read_records(str(ragged))


def test_unknown_chat_role_is_refused_with_the_known_ones(tmp_path):
    import copy

    from memkit.train.chat import CHAT_ROLES, chat_example, ensure_chat_template
    from memkit.train.tokenizer import byte_tokenizer

    tokenizer = copy.deepcopy(byte_tokenizer())  # the cached one would keep the template set on it
    ensure_chat_template(tokenizer)
    messages = [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(MemkitError, match=r"messages\[0\] has role 'robot'; use one of " + ", ".join(CHAT_ROLES)):
        chat_example(tokenizer, messages, where="--data x: line 1")


# ---- writes that fail ------------------------------------------------------------------------------

def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))


def test_export_on_a_full_disk_exits_2_and_leaves_no_temp_file(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format_version": 1, "machines": {"cpu|x": {"device": "cpu", "runs": [
        {"plan_kind": "full", "predicted": {"allocated_peak_bytes": 100}, "measured": {"allocated_peak_bytes": 120}}
    ] * 4}}}))
    out = tmp_path / "export"
    out.mkdir()
    env = {**os.environ, "MEMKIT_PROFILE": str(profile), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "memkit.cli.main", "calibrate", "--export", str(out / "p.json")],
                            env=env, capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("memkit: error: could not write calibration profile") and \
        result.stderr.count("\n") == 1, result.stderr
    assert list(out.iterdir()) == []


def test_write_text_atomic_keeps_the_old_file(tmp_path):
    from memkit.fileio import write_text_atomic

    target = tmp_path / "report.json"
    target.write_text("old\n")
    code = ("import sys; from memkit.fileio import write_text_atomic; from memkit.errors import MemkitError\n"
            "try:\n    write_text_atomic(sys.argv[1], 'x' * 4096, what='--report-json')\n"
            "except MemkitError as e:\n    print(e, file=sys.stderr); sys.exit(2)\n")
    result = subprocess.run([sys.executable, "-c", code, str(target)], env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300)
    assert result.returncode == 2 and "could not write --report-json" in result.stderr, result.stderr
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert write_text_atomic(target, "new\n", what="x").read_text() == "new\n"
