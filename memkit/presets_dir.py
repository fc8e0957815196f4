"""Where memkit's data (model and GPU catalogs, presets) lives: the repository's presets/ folder, which
a wheel ships as memkit/_presets/ (pyproject.toml maps the package memkit._presets onto presets/)."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGED = "_presets"  # the folder under memkit/ in an installed wheel (pyproject [tool.setuptools.package-dir])


def presets_dir() -> Path:
    """The data folder, first match wins:

    1. MEMKIT_PRESETS, when set: the user's own catalogs/presets beat everything shipped.
    2. The checkout's presets/ beside the package (a folder holding memkit/, presets/ and
       pyproject.toml: a clone, or an editable install, which imports memkit from the clone): the
       one copy of the data, so edits to presets/ are seen at once. It wins over (3) because a
       checkout holds no memkit/_presets/ unless a build wrote one into it, and such a copy goes
       stale; pyproject.toml marks the checkout, so an unrelated presets/ folder that another
       distribution put in site-packages beside an installed memkit is never taken for it.
    3. memkit/_presets/, the copy a wheel (`pip install .`) installs.
    """
    override = os.environ.get("MEMKIT_PRESETS")
    if override:
        return Path(override)
    package = Path(__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "presets").is_dir():
        return checkout / "presets"
    return package / PACKAGED
