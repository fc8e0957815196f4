"""A run folder that already holds a run is refused without --resume / --overwrite."""
from __future__ import annotations

import json

import pytest

from memkit.errors import MemkitError
from memkit.train.output_dir import check_output_dir, clear_run_outputs, run_status


def _log(folder, *records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_finished_unfinished_and_empty(tmp_path):
    assert run_status(tmp_path / "new") is None
    check_output_dir(tmp_path / "new", resume=None, overwrite=False)  # nothing there: fine
    _log(tmp_path / "done", {"event": "start"}, {"event": "end", "status": "ok"})
    _log(tmp_path / "stopped", {"event": "start"}, {"event": "end", "status": "interrupted"})
    (tmp_path / "crashed" / "checkpoints").mkdir(parents=True)
    assert [run_status(tmp_path / n) for n in ("done", "stopped", "crashed")] == ["finished", "unfinished",
                                                                                "unfinished"]
    with pytest.raises(MemkitError, match=r"already holds a finished run; pass --overwrite"):
        check_output_dir(tmp_path / "done", resume=None, overwrite=False)
    with pytest.raises(MemkitError, match=r"already holds an unfinished run; pass --resume to continue it"):
        check_output_dir(tmp_path / "stopped", resume=None, overwrite=False)
    check_output_dir(tmp_path / "stopped", resume="latest", overwrite=False)
    check_output_dir(tmp_path / "done", resume=None, overwrite=True)
    with pytest.raises(MemkitError, match=r"--overwrite and --resume both given"):
        check_output_dir(tmp_path / "done", resume="latest", overwrite=True)


def test_overwrite_removes_only_what_the_runner_wrote(tmp_path):
    _log(tmp_path, {"event": "end", "status": "ok"})
    (tmp_path / "final").mkdir()
    (tmp_path / "oom.rank1.json").write_text("{}")
    (tmp_path / "my_notes.txt").write_text("keep me")
    removed = clear_run_outputs(tmp_path)
    assert sorted(p.name for p in removed) == ["final", "log.jsonl", "oom.rank1.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_notes.txt"]
