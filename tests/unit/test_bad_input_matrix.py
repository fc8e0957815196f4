"""Bad input over every subcommand: exit code 2, exactly one line on stderr, no traceback, and
nothing written (the whole folder of inputs, a pre-existing --out bundle and run.sh included, is
byte-for-byte the same afterwards).

One parametrized test over estimate, suggest, explain, verify, train, launch-script, models and
gpus, in-process (memkit.cli.main.main), so ~300 cases take seconds. `verify` cases carry
`--timeout-s 1` and `train` cases `--dry-run`, so a case that slipped past validation would fail
fast (status, exit code) instead of launching a real run.

Unreadable files: the tests run as root, for whom chmod 000 blocks nothing, so the OS errors
here are honest ones root gets too: a folder where a file is expected (IsADirectoryError), a path
through a regular file (NotADirectoryError), /proc for writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from memkit.cli.main import main

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 256, "tie_word_embeddings": False}
BIG = "1" + "0" * 30  # 10^30
UNICODE_DIGITS = "\u0661\u0662"  # Arabic-Indic "12": Python's int() accepts it
BINARY = bytes(range(256)) * 4
NUMBERS = ["abc", "-1", BIG, "nan", "inf", UNICODE_DIGITS, "1e30", "2.5"]
"""Not an integer count in range; plus "0" where 0 is not allowed."""
FLOATS = ["abc", "nan", "inf", "-1", "1e30", UNICODE_DIGITS]
"""Not a finite number in range."""


def _config_text(**changes) -> str:
    return json.dumps({**TINY, **changes})


CONFIGS = {  # kind -> bytes of config.json (None: config.json is a folder)
    "not-json": b'{"model_type": "llama",, }',
    "json-list": b"[1, 2]",
    "utf16": _config_text().encode("utf-16"),
    "binary": BINARY,
    "latin1": '{"model_type": "llama", "note": "caf\xe9"}'.encode("latin-1"),
    "nan-token": _config_text().replace('"hidden_size": 64', '"hidden_size": NaN').encode(),
    "hidden-not-divisible": _config_text(hidden_size=66).encode(),
    "negative-layers": _config_text(num_hidden_layers=-2).encode(),
    "huge-hidden": _config_text(hidden_size=10**30).encode(),
    "string-hidden": _config_text(hidden_size="64").encode(),
    "no-model-type": json.dumps({k: v for k, v in TINY.items() if k != "model_type"}).encode(),
    "is-a-folder": None,
}


def _plan_changes(doc: dict, kind: str):
    """A plan.json damaged one way; returns the text (or bytes) to write."""
    d = json.loads(json.dumps(doc))
    if kind == "not-json":
        return "{" + json.dumps(d)[1:-1] + ",,}"
    if kind == "json-list":
        return "[]"
    if kind == "no-plan":
        del d["plan"]
    elif kind == "precision-fp8":
        d["plan"]["precision"] = "fp8"
    elif kind == "zero-7":
        d["plan"]["zero_stage"] = 7
    elif kind == "micro-string":
        d["plan"]["micro_batch_size"] = "two"
    elif kind == "micro-bool":
        d["plan"]["micro_batch_size"] = True
    elif kind == "lora-rank-string":
        d["plan"]["lora_rank"] = "x"
    elif kind == "unknown-plan-key":
        d["plan"]["flux_capacitor"] = 1
    elif kind == "estimate-string":
        d["estimate"]["nvidia_smi_peak_bytes"] = "big"
    elif kind == "no-estimate":
        del d["estimate"]
    elif kind == "nodes-0":
        d["hardware"]["num_nodes"] = 0
    elif kind == "no-host-ram":
        del d["hardware"]["host_ram_bytes_per_node"]
    elif kind == "unknown-model":
        d["model"] = "no-such-model"
    elif kind == "plan-is-list":
        d["plan"] = [1, 2]
    elif kind == "rejected-zero-time":
        d["rejected"] = [{"label": "x", "reason": "y", "step_time_s_if_it_fit": 0}]
    elif kind == "nan-token":
        return json.dumps(d).replace('"mfu": ', '"mfu": NaN, "was": ', 1)
    elif kind == "utf16":
        return json.dumps(d).encode("utf-16")
    elif kind == "binary":
        return BINARY
    return json.dumps(d)


PLAN_KINDS = ["not-json", "json-list", "no-plan", "precision-fp8", "zero-7", "micro-string", "micro-bool",
              "lora-rank-string", "unknown-plan-key", "estimate-string", "no-estimate", "nodes-0", "plan-is-list",
              "rejected-zero-time", "nan-token", "utf16", "binary", "is-a-folder"]
DATA = {"binary.jsonl": BINARY, "utf16.jsonl": '{"text": "hello"}\n'.encode("utf-16"),
        "latin1.txt": "caf\xe9 au lait\n".encode("latin-1"), "empty.jsonl": b""}
HOSTS = {"binary": BINARY, "utf16": "node1 slots=2\n".encode("utf-16"), "empty": b"", "slots": b"node1 slots=x\n"}


def _cases() -> list[tuple[str, list[str]]]:
    """(id, argv template); {name} placeholders are paths made by the `inputs` fixture."""
    est = ["estimate", "--model", "{tiny}", "--gpu", "a100-80gb", "--seq-len", "64"]
    sug = ["suggest", "--model", "{tiny}", "--gpu", "a100-80gb", "--seq-len", "64", "--global-batch-size", "8"]
    ver = ["verify", "--plan", "{plan}", "--timeout-s", "1", "--output-dir", "{work}/verify-out"]
    trn = ["train", "--plan", "{plan}", "--model", "{tiny}", "--data", "synthetic:8", "--output-dir",
           "{work}/train-out", "--dry-run"]
    lsc = ["launch-script", "--plan", "{plan}", "--slurm", "--out", "{runsh}"]
    cases: list[tuple[str, list[str]]] = []

    def numbers(cmd, base, flag, values=NUMBERS, zero_bad=True):
        for value in values + (["0"] if zero_bad else []):
            cases.append((f"{cmd}-{flag}={value[:12]}", [*base, flag, value]))

    for flag in ("--micro-batch-size", "--seq-len", "--grad-accum", "--num-gpus", "--num-nodes", "--tp", "--pp"):
        numbers("estimate", est, flag)
    numbers("estimate", est, "--lora-rank", zero_bad=False)
    for flag in ("--gpu-memory", "--host-ram"):
        for value in ("abc", "-1GiB", "0", BIG + "GiB", "nanGiB", UNICODE_DIGITS + "GiB", "1e30", "0.5B"):
            base = est if flag == "--host-ram" else [a for a in est if a not in ("--gpu", "a100-80gb")]
            cases.append((f"estimate-{flag}={value[:12]}", [*base, flag, value]))
    cases.append(("estimate-lora-targets-commas", [*est, "--lora-rank", "8", "--lora-targets", ",,,"]))
    cases.append(("estimate-lora-targets-unknown", [*est, "--lora-rank", "8", "--lora-targets", "nope"]))
    cases.append(("estimate-plot-txt", [*est, "--plot", "{work}/x.txt"]))
    cases.append(("estimate-plot-proc", [*est, "--plot", "/proc/x.png"]))
    cases.append(("estimate-unknown-flag", [*est, "--bogus"]))
    cases.append(("estimate-unknown-model", ["estimate", "--model", "no-such-model", "--gpu", "a100-80gb"]))

    for flag in ("--global-batch-size", "--seq-len", "--max-micro-batch", "--num-gpus"):
        numbers("suggest", sug, flag)
    numbers("suggest", sug, "--lr", values=FLOATS)
    numbers("suggest", sug, "--num-alternatives", values=["abc", "-1", BIG, "nan", UNICODE_DIGITS], zero_bad=False)
    for value in ("nan", "inf", UNICODE_DIGITS + "%", "95%", "-5%", "abc"):
        cases.append((f"suggest-headroom={value}", [*sug, "--headroom", value]))
    for flag in ("--tp", "--pp"):
        for value in ("x", "0", "-2", UNICODE_DIGITS, BIG):
            cases.append((f"suggest-{flag}={value[:12]}", [*sug, flag, value]))
    cases += [
        ("suggest-out-is-file", [*sug, "--out", "{afile}"]),
        ("suggest-out-through-file", [*sug, "--out", "{afile}/sub"]),
        ("suggest-out-proc", [*sug, "--out", "/proc/memkit-bundle"]),
        ("suggest-existing-out-plot-proc", [*sug, "--out", "{bundle}", "--plot", "/proc/x.png"]),
        ("suggest-existing-out-plot-folder", [*sug, "--out", "{bundle}", "--plot", "{adir}.png"]),
        ("suggest-existing-out-plot-txt", [*sug, "--out", "{bundle}", "--plot", "{work}/plot.txt"]),
        ("suggest-existing-out-plot-no-parent", [*sug, "--out", "{bundle}", "--plot", "{work}/none/p.png"]),
        ("suggest-existing-out-ds-config-folder", [*sug, "--out", "{odd_bundle}"]),
        ("suggest-lora-targets-commas", [*sug, "--lora-rank", "8", "--lora-targets", ",,,"]),
        ("suggest-missing-batch", sug[:-2]),
        ("suggest-stack-bad-version", [*sug, "--stack", "transformers=abc"]),
        ("suggest-stack-unknown-package", [*sug, "--stack", "jax=0.4"]),
        ("estimate-stack-bad-version", [*est, "--stack", "torch=x"]),
    ]

    for kind in CONFIGS:
        cases.append((f"estimate-config-{kind}", [*est[:2], f"{{cfg_{kind}}}", *est[3:]]))
        cases.append((f"suggest-config-{kind}", [*sug[:2], f"{{cfg_{kind}}}", *sug[3:]]))
        cases.append((f"train-config-{kind}", [*trn[:4], f"{{cfg_{kind}}}", *trn[5:]]))
    cases.append(("estimate-config-through-file", [*est[:2], "{afile}/config.json", *est[3:]]))

    for kind in PLAN_KINDS:
        cases.append((f"explain-plan-{kind}", ["explain", f"{{plan_{kind}}}"]))
        cases.append((f"verify-plan-{kind}", [ver[0], "--plan", f"{{plan_{kind}}}", *ver[3:]]))
        cases.append((f"train-plan-{kind}", [trn[0], "--plan", f"{{plan_{kind}}}", *trn[3:]]))
        cases.append((f"launch-script-plan-{kind}", [lsc[0], "--plan", f"{{plan_{kind}}}", *lsc[3:]]))
    for kind in ("no-host-ram", "unknown-model"):  # only `explain --check` rebuilds these
        cases.append((f"explain-check-{kind}", ["explain", "--check", f"{{plan_{kind}}}"]))
    cases.append(("explain-missing", ["explain", "{work}/nothing/plan.json"]))
    cases.append(("explain-through-file", ["explain", "{afile}/plan.json"]))

    numbers("verify", ver, "--steps")
    numbers("verify", ver, "--timeout-s", values=["abc", "-1", BIG, "nan", UNICODE_DIGITS])
    for name in DATA:
        cases.append((f"verify-data-{name}", [*ver, "--data", f"{{work}}/data/{name}"]))
        cases.append((f"train-data-{name}", [*trn[:5], "--data", f"{{work}}/data/{name}", *trn[7:]]))
    for value in ("synthetic:abc", "synthetic:" + BIG, "synthetic:-1", "synthetic:" + UNICODE_DIGITS, "/nonexistent"):
        cases.append((f"verify-data-{value[:16]}", [*ver, "--data", value]))
        cases.append((f"train-data-{value[:16]}", [*trn[:5], "--data", value, *trn[7:]]))
    cases += [
        ("verify-data-empty-string", [*ver, "--data", ""]),
        ("verify-data-plain-folder", [*ver, "--data", "{adir}"]),
        ("verify-model-not-a-config", [*ver, "--model", "{plan}"]),
        ("verify-model-empty", [*ver, "--model", ""]),
        ("verify-model-hidden-not-divisible", [*ver, "--model", "{cfg_hidden-not-divisible}"]),
        ("verify-config-file-not-accelerate", [*ver, "--config-file", "{plan}"]),
        ("verify-output-dir-nul", [*ver, "--output-dir", "a\x00b"]),
        ("verify-output-dir-is-file", [*ver[:4], "--output-dir", "{afile}"]),
        ("verify-no-config", ["verify", "--plan", "{plan_alone}", "--timeout-s", "1"]),
        ("verify-config-file-binary", [*ver, "--config-file", "{host_binary}"]),
    ]

    for flag in ("--max-steps", "--micro-batch-size", "--grad-accum", "--seq-len", "--keep-checkpoints"):
        numbers("train", trn, flag)
    for flag in ("--lr", "--lora-dropout", "--weight-decay", "--min-lr-ratio", "--gradient-clipping"):
        numbers("train", trn, flag, values=FLOATS, zero_bad=False)
    for flag in ("--seed", "--save-every", "--warmup-steps"):
        numbers("train", trn, flag, values=["abc", "-1", BIG, UNICODE_DIGITS], zero_bad=False)
    numbers("train", trn, "--num-epochs", values=FLOATS)  # 1e30 passes would overflow the step count
    cases += [
        ("train-eval-every-beyond-run", [*trn, "--max-steps", "10", "--eval-every", "100000"]),
        ("train-eval-every-negative", [*trn, "--eval-every", "-1"]),
        ("launch-script-cpus-per-node-huge", [*lsc, "--cpus-per-node", "100000"]),
        ("suggest-main-process-ip-hostile", [*sug, "--main-process-ip", "$(touch x)"]),
        ("suggest-global-batch-beyond-ceiling", [*sug[:-2], "--global-batch-size", str(2**20 + 1)]),
        ("train-data-fifo", [*trn[:5], "--data", "{fifo}", *trn[7:]]),
    ]
    cases += [
        ("train-resume-missing", [*trn, "--resume", "/nonexistent"]),
        ("train-resume-file", [*trn, "--resume", "{afile}"]),
        ("train-contradicting-micro", [*trn, "--micro-batch-size", "7"]),
        ("train-contradicting-seq", [*trn, "--seq-len", "65"]),
        ("train-output-dir-is-file", [*trn[:6], "--output-dir", "{afile}", "--dry-run"]),
        ("train-report-json-folder", [*trn, "--report-json", "{adir}"]),
        ("train-lora-targets-commas", [*trn, "--lora-targets", ",,,"]),
        ("train-no-model", ["train", "--data", "synthetic", "--output-dir", "{work}/t", "--dry-run"]),
    ]

    for flag in ("--port", "--num-machines", "--gpus-per-node"):
        numbers("launch-script", lsc, flag)
    cases.append(("launch-script-port-99999", [*lsc, "--port", "99999"]))
    cases.append(("launch-script-port-65536", [*lsc, "--port", "65536"]))
    for kind in HOSTS:
        cases.append((f"launch-script-hostfile-{kind}", [lsc[0], "--plan", "{plan}", "--hostfile", f"{{host_{kind}}}",
                                                           "--out", "{runsh}"]))
    cases += [
        ("launch-script-hostfile-folder", [lsc[0], "--plan", "{plan}", "--hostfile", "{adir}", "--out", "{runsh}"]),
        ("launch-script-hostfile-missing", [lsc[0], "--plan", "{plan}", "--hostfile", "/nonexistent", "--out", "{runsh}"]),
        ("launch-script-out-folder", [*lsc[:4], "--out", "{adir}"]),
        ("launch-script-out-proc", [*lsc[:4], "--out", "/proc/run.sh"]),
        ("launch-script-out-no-parent", [*lsc[:4], "--out", "{work}/none/run.sh"]),
        ("launch-script-both-modes", [*lsc, "--hostfile", "{host_empty}"]),
    ]
    cases += [
        ("models-json-and-markdown", ["models", "--json", "--markdown"]),
        ("models-unknown-flag", ["models", "--limit", "5"]),
        ("models-two-filters", ["models", "a", "b"]),
        ("gpus-extra-argument", ["gpus", "extra"]),
        ("gpus-unknown-flag", ["gpus", "--bogus"]),
        ("no-such-command", ["frobnicate"]),
    ]
    return cases


CASES = _cases()


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("bad-input")
    paths = {"work": str(work)}
    tiny = work / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY))
    paths["tiny"] = str(tiny)
    for kind, data in CONFIGS.items():
        folder = work / "configs" / kind
        folder.mkdir(parents=True)
        if data is None:
            (folder / "config.json").mkdir()
        else:
            (folder / "config.json").write_bytes(data)
        paths[f"cfg_{kind}"] = str(folder)
    bundle = work / "bundle"
    assert main(["suggest", "--model", str(tiny), "--gpu", "a100-80gb", "--num-gpus", "2", "--seq-len", "64",
                 "--global-batch-size", "8", "--zero", "2", "--out", str(bundle)]) == 0
    paths["bundle"], paths["plan"] = str(bundle), str(bundle / "plan.json")
    odd = work / "odd-bundle"
    shutil.copytree(bundle, odd)
    (odd / "ds_config.json").unlink()
    (odd / "ds_config.json").mkdir()
    paths["odd_bundle"] = str(odd)
    doc = json.loads((bundle / "plan.json").read_text())
    for kind in PLAN_KINDS:
        folder = work / "plans" / kind
        shutil.copytree(bundle, folder)
        target = folder / "plan.json"
        if kind == "is-a-folder":
            target.unlink()
            target.mkdir()
        else:
            text = _plan_changes(doc, kind)
            target.write_bytes(text if isinstance(text, bytes) else text.encode())
        paths[f"plan_{kind}"] = str(target)
    for kind in ("no-host-ram", "unknown-model"):
        folder = work / "plans" / kind
        shutil.copytree(bundle, folder)
        (folder / "plan.json").write_text(_plan_changes(doc, kind))
        paths[f"plan_{kind}"] = str(folder / "plan.json")
    alone = work / "plan-alone"
    alone.mkdir()
    shutil.copy(bundle / "plan.json", alone / "plan.json")
    paths["plan_alone"] = str(alone / "plan.json")
    (work / "data").mkdir()
    for name, data in DATA.items():
        (work / "data" / name).write_bytes(data)
    for kind, data in HOSTS.items():
        (work / f"hosts-{kind}").write_bytes(data)
        paths[f"host_{kind}"] = str(work / f"hosts-{kind}")
    os.mkfifo(work / "data" / "fifo.jsonl")  # opening it would block: refused from its type
    paths["fifo"] = str(work / "data" / "fifo.jsonl")
    (work / "a-file").write_text("not a folder\n")
    (work / "a-dir").mkdir()
    (work / "a-dir.png").mkdir()
    paths["afile"], paths["adir"] = str(work / "a-file"), str(work / "a-dir")
    (work / "run.sh").write_text("#!/bin/bash\necho an existing script\n")
    paths["runsh"] = str(work / "run.sh")
    return paths


@pytest.mark.parametrize("argv", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, inputs, capsys, monkeypatch):
    work = Path(inputs["work"])
    monkeypatch.chdir(work)
    before = _snapshot(work)
    args = [a.format(**inputs) for a in argv]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert err.count("\n") == 1 and err.startswith("memkit: error: "), err
    assert err.strip() and "Traceback" not in err + out, err + out
    assert _snapshot(work) == before, "a failed command changed files"
    assert not any(name.startswith(".memkit") for name in os.listdir(work))


def test_resuggest_pipeline_plan_removes_stale_deepspeed_file(inputs, tmp_path):
    """A pipeline plan has no ds_config.json: re-suggesting one into an old DeepSpeed bundle removes
    the stale file (an accelerate.yaml beside an unrelated ds_config.json would mislead), keeps
    other files in the folder, and leaves no temporary folder behind."""
    out = tmp_path / "bundle"
    shutil.copytree(inputs["bundle"], out)
    (out / "notes.txt").write_text("mine\n")
    assert (out / "ds_config.json").is_file()
    code = main(["suggest", "--model", inputs["tiny"], "--gpu", "a100-80gb", "--num-gpus", "2", "--seq-len", "64",
                 "--global-batch-size", "8", "--pp", "2", "--zero", "0", "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "accelerate.yaml", "notes.txt", "plan.json"]
    assert json.loads((out / "plan.json").read_text())["plan"]["pp"] == 2


def test_text_checks_accept_real_utf8(tmp_path):
    """The encoding checks refuse only what is wrong: multi-byte UTF-8 across the 4 KiB sniff window
    and the 1 MiB read chunks, and a UTF-8 BOM, pass; the same text in UTF-16 without a BOM does not."""
    from memkit.errors import MemkitError
    from memkit.fileio import check_text_file, read_text

    text = "Grüße, 東京 — ünïcödé\n" * 60_000  # ~1.7 MB: crosses the 1 MiB chunk boundary
    path = tmp_path / "data.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert check_text_file(path) == path
    assert read_text(path, max_bytes=4 * 1024**2) == text
    path.write_bytes("plain ascii text\n".encode("utf-16-le"))
    with pytest.raises(MemkitError, match="UTF-16"):
        check_text_file(path, what="--data")


# ---- mutations generated from the schemas (memkit/plan/plan_schema.py) ---------------------------------

def _wrong_values(spec) -> list[tuple[str, object]]:
    """(kind, value) that the field `spec` must refuse: a wrong JSON type, out of range."""
    wrong_type = {"int": "7", "float": "0.5", "str": 7, "bool": "yes", "names": "q_proj", "object": [1],
                  "list": {"a": 1}}[spec.kind]
    out = [("type", wrong_type)]
    if spec.kind == "int":
        out.append(("float", 2.5))
    if spec.kind in ("int", "float"):
        if spec.lo is not None:
            out.append(("below", spec.lo - 1))
        if spec.hi is not None:
            out.append(("above", spec.hi * 10 + 1))
    return out


def _schema_cases() -> list[tuple[str, str, str, object]]:
    """(id, section, field, value or MISSING) for every field of plan.json's schema."""
    from memkit.plan.plan_schema import SECTIONS, TOP, plan_fields

    tables = {"": {k: v for k, v in TOP.items() if k not in SECTIONS and k != "plan"}, "plan": plan_fields(),
              **SECTIONS}
    cases = []
    for section, specs in tables.items():
        for name, spec in specs.items():
            for kind, value in _wrong_values(spec):
                cases.append((f"{section or 'top'}.{name}-{kind}", section, name, value))
            if spec.required:
                cases.append((f"{section or 'top'}.{name}-missing", section, name, MISSING))
    return cases


MISSING = object()
SCHEMA_CASES = _schema_cases()


def _mutated(doc: dict, section: str, name: str, value) -> dict:
    d = json.loads(json.dumps(doc))
    block = d[section] if section else d
    if value is MISSING:
        block.pop(name, None)  # the task fields are left out at their defaults (TrainingPlan.to_dict)
    else:
        block[name] = value
    return d


def _assert_refused(args, work: Path, capsys) -> str:
    before = _snapshot(work)
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert err.count("\n") == 1 and err.startswith("memkit: error: "), err
    assert "Traceback" not in err + out, err + out
    assert _snapshot(work) == before, "a failed command changed files"
    return err


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_plan_json_schema_mutation_is_refused(case, inputs, tmp_path, capsys, monkeypatch):
    """Every plan.json field the schema knows, with a wrong type, out of range or (required) missing:
    `explain` (and `launch-script` for plan knobs) refuse it in one line naming the field."""
    _, section, name, value = case
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "bundle"
    shutil.copytree(inputs["bundle"], folder)
    doc = json.loads((folder / "plan.json").read_text())
    (folder / "plan.json").write_text(json.dumps(_mutated(doc, section, name, value)))
    err = _assert_refused(["explain", str(folder / "plan.json")], tmp_path, capsys)
    assert name in err, err
    if section == "plan":
        _assert_refused(["launch-script", "--plan", str(folder / "plan.json"), "--slurm", "--out",
                         str(tmp_path / "run.sh")], tmp_path, capsys)


def test_optional_plan_fields_default_when_missing(inputs):
    """A plan field the schema does not require reads as TrainingPlan's default (DeepSpeed's own)."""
    from memkit.emit import plan_doc
    from memkit.plan.plan import TrainingPlan
    from memkit.plan.plan_schema import plan_fields

    doc = json.loads(Path(inputs["plan"]).read_text())
    optional = [name for name, spec in plan_fields().items() if not spec.required]
    assert len(optional) >= 20
    for name in optional:
        d = _mutated(doc, "plan", name, MISSING)
        if name in ("lora_targets",):
            continue
        plan = plan_doc.check(d, where="plan.json").plan
        assert getattr(plan, name) == getattr(TrainingPlan(), name), name


@pytest.mark.parametrize("change, needle", [
    ({"plan.checkpointing": "99"}, "the model has 2 blocks"),
    ({"plan.dp": 4}, "the hardware has 2"),
    ({"plan.micro_batch_size": 10**6}, "plan.micro_batch_size"),
    ({"plan.gradient_clipping": -1.0}, "plan.gradient_clipping"),
    ({"plan.reduce_bucket_size": -5}, "plan.reduce_bucket_size"),
    ({"model": ""}, "model"),
    ({"estimate.nvidia_smi_peak_bytes": -1}, "estimate.nvidia_smi_peak_bytes"),
    ({"format_version": "v2"}, "format_version 'v2' is not a plan.json format number"),
    ({"format_version": 2}, "plan.json format 2, written by memkit"),
    ({"plan": "a string"}, "plan"),
])
def test_hand_edited_plan_json_is_refused_by_every_reader(change, needle, inputs, tmp_path, capsys, monkeypatch):
    """The issue's hand edits: explain, explain --check, train --plan and launch-script all refuse them."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "bundle"
    shutil.copytree(inputs["bundle"], folder)
    doc = json.loads((folder / "plan.json").read_text())
    for key, value in change.items():
        section, _, name = key.rpartition(".")
        doc = _mutated(doc, section, name, value)
    (folder / "plan.json").write_text(json.dumps(doc))
    plan = str(folder / "plan.json")
    for argv in (["explain", plan], ["explain", "--check", plan],
                 ["train", "--plan", plan, "--model", inputs["tiny"], "--data", "synthetic:8", "--output-dir",
                  str(tmp_path / "t"), "--dry-run"],
                 ["launch-script", "--plan", plan, "--slurm", "--out", str(tmp_path / "run.sh")]):
        err = _assert_refused(argv, tmp_path, capsys)
        assert needle in err, (argv[0], err)


def test_previous_format_is_migrated(inputs):
    """A version-0 document (no format_version; "model" as an object) reads as version 1 does."""
    from memkit.emit import plan_doc

    doc = json.loads(Path(inputs["plan"]).read_text())
    old = {k: v for k, v in doc.items() if k != "format_version"}
    old["model"] = {"name": doc["model"]}
    migrated = plan_doc.check(old, where="plan.json")
    assert migrated.model == doc["model"] and migrated.plan == plan_doc.check(doc, where="plan.json").plan


def _deepspeed_cases() -> list[tuple[str, str, object]]:
    """(id, dotted key, value) from ds_config.json's schema: the batch counts, and every field of the
    zero_optimization / bf16 block memkit writes, typed by DeepSpeed's own models."""
    from memkit.plan.plan_schema import DEEPSPEED_BATCH_KEYS

    cases = []
    for key in DEEPSPEED_BATCH_KEYS:
        cases += [(f"{key}-type", key, "8"), (f"{key}-zero", key, 0), (f"{key}-float", key, 2.5)]
    cases += [("gradient_clipping-negative", "gradient_clipping", -1.0), ("optimizer-list", "optimizer", [1]),
              ("zero-list", "zero_optimization", [1]), ("bf16-string", "bf16", "on")]
    for key, bad in (("stage", "1"), ("stage", 7), ("stage", True), ("reduce_bucket_size", -5),
                     ("reduce_bucket_size", "big"), ("allgather_bucket_size", -1), ("overlap_comm", "yes"),
                     ("contiguous_gradients", 1), ("offload_optimizer", "cpu")):
        cases.append((f"zero_optimization.{key}={bad!r}", f"zero_optimization.{key}", bad))
    cases.append(("bf16.enabled='yes'", "bf16.enabled", "yes"))
    return cases


DEEPSPEED_CASES = _deepspeed_cases()


@pytest.mark.parametrize("case", DEEPSPEED_CASES, ids=[c[0] for c in DEEPSPEED_CASES])
def test_hand_edited_deepspeed_config_is_refused(case, inputs, tmp_path, capsys, monkeypatch):
    """A ds_config.json field with the wrong type or out of DeepSpeed's range: launch-script and
    train refuse it in one line naming the field, before anything runs or is written."""
    _, key, value = case
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "bundle"
    shutil.copytree(inputs["bundle"], folder)
    acc = (folder / "accelerate.yaml").read_text().replace(inputs["bundle"], str(folder))
    (folder / "accelerate.yaml").write_text(acc)
    ds = json.loads((folder / "ds_config.json").read_text())
    section, _, name = key.rpartition(".")
    (ds[section] if section else ds)[name] = value
    (folder / "ds_config.json").write_text(json.dumps(ds))
    plan = str(folder / "plan.json")
    for argv in (["launch-script", "--plan", plan, "--slurm", "--out", str(tmp_path / "run.sh")],
                 ["train", "--plan", plan, "--model", inputs["tiny"], "--data", "synthetic:8", "--output-dir",
                  str(tmp_path / "t"), "--dry-run"]):
        err = _assert_refused(argv, tmp_path, capsys)
        assert name in err, err


@pytest.mark.parametrize("damage", ["truncated", "list", "folder", "missing", "disagrees"])
def test_damaged_deepspeed_file_is_refused(damage, inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "bundle"
    shutil.copytree(inputs["bundle"], folder)
    (folder / "accelerate.yaml").write_text((folder / "accelerate.yaml").read_text().replace(inputs["bundle"],
                                                                                           str(folder)))
    target = folder / "ds_config.json"
    text = target.read_text()
    if damage == "truncated":
        target.write_text(text[: len(text) // 2])
    elif damage == "list":
        target.write_text("[]")
    elif damage in ("folder", "missing"):
        target.unlink()
        if damage == "folder":
            target.mkdir()
    else:
        ds = json.loads(text)
        ds["zero_optimization"]["stage"] = 3
        target.write_text(json.dumps(ds))
    err = _assert_refused(["launch-script", "--plan", str(folder / "plan.json"), "--slurm", "--out",
                           str(tmp_path / "run.sh")], tmp_path, capsys)
    assert "ds_config.json" in err, err


ACCELERATE_CASES = [("num_processes", "2"), ("num_processes", 0), ("num_machines", -1), ("machine_rank", "x"),
                    ("main_process_port", 70000), ("distributed_type", "QUANTUM"), ("use_cpu", "no"),
                    ("main_process_ip", "a;rm -rf x"), ("deepspeed_config", "ds.json"), ("bogus_key", 1)]


@pytest.mark.parametrize("key, value", ACCELERATE_CASES, ids=[f"{k}={v!r}" for k, v in ACCELERATE_CASES])
def test_hand_edited_accelerate_config_is_refused(key, value, inputs, tmp_path, capsys, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "bundle"
    shutil.copytree(inputs["bundle"], folder)
    acc = yaml.safe_load((folder / "accelerate.yaml").read_text().replace(inputs["bundle"], str(folder)))
    acc[key] = value
    (folder / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    err = _assert_refused(["launch-script", "--plan", str(folder / "plan.json"), "--slurm", "--out",
                           str(tmp_path / "run.sh")], tmp_path, capsys)
    assert key in err, err
