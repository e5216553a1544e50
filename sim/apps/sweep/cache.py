"""The sweep cache: each simulated variant's summary on disk, keyed by a content hash of its
fully resolved scenario, the simulator's version and source, and the step count.

Part of :mod:`sim.apps.sweep` (which re-exports every public name here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from sim.analysis.summary import Summary
from sim.scenario import Scenario

DEFAULT_CACHE_DIRNAME = ".fabricsim-cache"
"""The cache folder's name, placed next to ``--out`` (or in the current folder)."""


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 over the simulator's source and data files (``sim/``, without the bundled
    scenario copies), so a cache entry made by other code is never served."""
    root = Path(__file__).resolve().parents[2]   # the sim/ package folder
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (not path.is_file() or "__pycache__" in rel.parts or rel.parts[0] == "_bundled"
                or path.suffix in (".pyc", ".pyo")):
            continue
        h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(scenario: Scenario, steps: int) -> str:
    """Content hash of one simulation's inputs: the fully resolved scenario's JSON (topology
    merged, every default filled), the simulator's version and source digest, the step count.
    """
    from sim import __version__

    material = {"scenario": scenario.model_dump(mode="json"), "version": __version__,
                "code": code_digest(), "steps": steps}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


class SweepCache:
    """Summaries on disk, one JSON file per cache key (``DIR/ab/abcdef....json``).

    Written by the process that gathers the results (workers on other machines need no
    shared disk), atomically (a temporary file renamed into place), so an interrupted sweep
    leaves only whole entries. An unreadable entry counts as missing.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> tuple[dict[str, Any], float] | None:
        """The cached summary and the wall seconds its simulation took, or None."""
        try:
            entry = json.loads(self._path(key).read_text())
            return entry["summary"], float(entry["wall_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, summary: Summary, wall_s: float) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_beside(path)
        tmp.write_text(json.dumps({"summary": summary, "wall_s": wall_s}))
        os.replace(tmp, path)


def temporary_beside(path: Path) -> Path:
    """Where to write ``path`` before renaming it into place."""
    # Same folder (so os.replace is atomic), a name no other process writes at once.
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")

