"""Every preset under presets/plans/ is what `memkit suggest --out presets/plans/NAME --relative-paths`
writes for its request today (presets keep repository-relative paths; `memkit preset NAME --out DIR`
and `memkit train` resolve them for a launch from anywhere):
the same files, byte for byte, apart from plan.json's installed versions (issue #8: presets
once used their own host-RAM default and chose differently from suggest).

`python -m memkit.presets_gen` is the one way presets are written; rerun it after any change to
the estimator, the planner or the emitters (tests/unit/test_planner_presets.py says when).
"""
from __future__ import annotations

import json

import pytest

from memkit.cli.main import main
from memkit.emit.plan_doc import VERSION_KEYS, comparable, to_text
from memkit.presets_dir import presets_dir
from memkit.presets_gen import COUNTS, FILES, GPUS, MODELS, SEQ_LENS, PresetRequest

PLANS = presets_dir() / "plans"
NAMES = sorted(p.name for p in PLANS.iterdir()) if PLANS.is_dir() else []
REQUESTS = {r.name: r for r in (PresetRequest(m, g, n, s, lora) for m in MODELS for g in GPUS.values()
                                 for n in COUNTS for s in SEQ_LENS for lora in (False, True))}


def WORKER_GROUP(item) -> str:
    """tests/conftest.py: the rows of one model, mode and sequence length run in one worker process
    (presets_gen's own split, _worker_tasks): their cards search the same plan structures, so their
    searches reuse each other's allocator replays (estimate/memory.py _replay), and no other file's
    tests run between them to push those out of the memo. Measured on this file alone under two
    workers: 44.4 CPU s handed out one by one, 41.4 CPU s grouped (tests/conftest.py CPU_REPORT)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    request = REQUESTS.get(params.get("name"))
    return "" if request is None else f"{request.model} {request.lora} {request.seq_len}"


def test_every_preset_names_a_request():
    assert NAMES and set(NAMES) <= set(REQUESTS)


@pytest.mark.slow  # one full `memkit suggest` per preset (133; ~1.7 CPU s each): the inner loop skips it
@pytest.mark.parametrize("name", NAMES)
def test_preset_is_what_suggest_writes(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # so that --out is the preset's own relative path
    out = f"presets/plans/{name}"
    assert main(["suggest", *REQUESTS[name].suggest_argv(), "--out", out, "--relative-paths"]) == 0
    capsys.readouterr()
    committed = sorted(p.name for p in (PLANS / name).iterdir())
    written = sorted(f for f in FILES if (tmp_path / out / f).is_file())
    assert committed == written
    for fname in written:
        ours, theirs = (tmp_path / out / fname).read_text(), (PLANS / name / fname).read_text()
        if fname == "plan.json":  # byte for byte once the installed versions are the committed ones
            doc = json.loads(ours)
            assert set(doc) - set(VERSION_KEYS) == set(comparable(json.loads(theirs)))
            doc.update({k: json.loads(theirs)[k] for k in VERSION_KEYS})
            ours = to_text(doc)
        assert ours == theirs, fname
