"""Where memkit's data (catalogs, presets) lives: the repository's presets/ folder."""
from __future__ import annotations

import os
from pathlib import Path


def presets_dir() -> Path:
    """presets/ beside the memkit package (editable install or checkout); MEMKIT_PRESETS overrides."""
    override = os.environ.get("MEMKIT_PRESETS")
    return Path(override) if override else Path(__file__).resolve().parent.parent / "presets"
