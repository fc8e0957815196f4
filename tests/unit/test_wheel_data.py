"""A wheel (`pip install .`, non-editable) ships the data: every tracked file under presets/ sits in it
at memkit/_presets/ (pyproject.toml maps the package memkit._presets onto presets/), byte for byte,
and a memkit installed from it alone (no checkout on the path) resolves its catalogs and presets
there (memkit.presets_dir) and plans a bundled model.

The wheel is built offline (--no-index, --no-build-isolation: the installed setuptools) from a copy
of the tracked files the build reads, so a build/ folder left in the checkout cannot add stale files."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memkit.presets_dir import PACKAGED as PACKAGE_FOLDER

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = f"memkit/{PACKAGE_FOLDER}/"  # where presets/ lands in the wheel
MODEL = "llama-3.1-8b"  # a bundled catalog name (`memkit models`; presets/models/catalog.json)


def tracked(*paths: str) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *paths], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs a git checkout to list the tracked files ({exc})")
    return sorted(name for name in out.decode().split("\0") if name)


def pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in tracked("pyproject.toml", "README.md", "memkit", "presets"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src))
    (whl,) = out.glob("memkit-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("target")
    pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel))
    return target


def run_installed(target: Path, cwd: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """python -S: no .pth files, so the checkout's editable install (a meta-path finder a .pth starts)
    stays off; the path is the install target, then the interpreter's site-packages for the deps."""
    deps = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEMKIT_PRESETS")}
    env.update(PYTHONPATH=os.pathsep.join([str(target), *deps]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-S", "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_the_wheel_holds_every_tracked_presets_file_and_module_byte_for_byte(wheel):
    presets, modules = tracked("presets"), [n for n in tracked("memkit") if n.endswith(".py")]
    assert presets and modules
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = [n for n in presets if PACKAGED + n.removeprefix("presets/") not in names]
        missing += [n for n in modules if n not in names]
        assert not missing, (f"{len(missing)} tracked files not in {wheel.name} (pyproject [tool.setuptools] "
                             f"packages / package-data), e.g. {missing[:5]}")
        for name in presets:
            assert zf.read(PACKAGED + name.removeprefix("presets/")) == (ROOT / name).read_bytes(), name
        for name in modules:
            assert zf.read(name) == (ROOT / name).read_bytes(), name


def test_an_installed_wheel_finds_its_data_without_the_checkout(installed, tmp_path):
    probe = run_installed(installed, tmp_path, (
        "import json, sys, memkit; from memkit.presets_dir import presets_dir; "
        "from memkit.cli.preset import preset_names; "
        "print(json.dumps({'file': memkit.__file__, 'presets': str(presets_dir()), 'path': sys.path, "
        "'presets_listed': len(preset_names())}))"))
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    here = installed.resolve()
    assert Path(got["file"]).resolve().is_relative_to(here)
    assert Path(got["presets"]) == here / "memkit" / "_presets"
    assert not [p for p in got["path"] if p and Path(p).resolve().is_relative_to(ROOT)], got["path"]
    assert got["presets_listed"] == len({n.split("/")[2] for n in tracked("presets/plans") if n.endswith("/plan.json")})

    main = "import sys; from memkit.cli.main import main; sys.exit(main(sys.argv[1:]))"
    suggest = run_installed(installed, tmp_path, main, "suggest", "--model", MODEL, "--gpu", "rtx-4090",
                            "--num-gpus", "2", "--global-batch-size", "64", "--seq-len", "2048")
    assert suggest.returncode == 0, suggest.stdout + suggest.stderr
    assert "Traceback" not in suggest.stderr

    name = "llama-3.2-1b-full-1xh100-80gb-4k"
    shown = run_installed(installed, tmp_path, main, "preset", name)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    # an install has no folder the repository-relative paths hold from: only the --out advice (memkit.cli.preset)
    assert "run from" not in shown.stdout and f"memkit preset {name} --out DIR" in shown.stdout
    written = run_installed(installed, tmp_path, main, "preset", name, "--out", "bundle")
    assert written.returncode == 0, written.stdout + written.stderr
    committed = ROOT / "presets" / "plans" / name / "plan.json"
    assert (tmp_path / "bundle" / "plan.json").read_bytes() == committed.read_bytes()
