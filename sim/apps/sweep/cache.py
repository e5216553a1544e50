"""The sweep cache: each simulated variant's summary on disk, keyed by a content hash of its
fully resolved scenario, the simulator's version and source, and the step count.

Entries are written so that an interrupted or crashed sweep, a full disk or two sweeps
sharing the folder never serve a wrong summary:

- **atomically**: the entry is written to a temporary file of a name no other writer uses
  (process id and a random token) in the entry's own folder, then renamed into place with
  ``os.replace`` (atomic on POSIX and Windows within one file system), so a reader sees
  the old file, the new one or none, never half of one. Two sweeps writing the same key
  write the same bytes (the simulation is deterministic), so the last rename wins harmlessly.
- **checked**: each entry carries its key and a SHA-256 of its payload. An entry that does
  not parse, names another key or fails its checksum (a file truncated by a crash before
  its data reached the disk: the rename is not preceded by ``fsync``, which would cost
  milliseconds a variant) counts as missing, is removed, and is simulated again.
- **best effort**: a write that fails (no space left, a read-only folder) is counted and
  reported, and the sweep goes on without that entry.

Part of :mod:`sim.apps.sweep` (which re-exports every public name here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from sim.analysis.summary import Summary
from sim.scenario import Scenario

DEFAULT_CACHE_DIRNAME = ".fabricsim-cache"
"""The cache folder's name, placed next to ``--out`` (or in the current folder)."""

ENTRY_FORMAT = 2
"""Version of an entry's layout; entries of another layout count as missing."""


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


def _payload_digest(key: str, summary: Any, wall_s: Any) -> str:
    body = json.dumps({"key": key, "summary": summary, "wall_s": wall_s}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


class SweepCache:
    """Summaries on disk, one JSON file per cache key (``DIR/ab/abcdef....json``).

    Written by the process that gathers the results (workers on other machines need no
    shared disk); see the module docstring for how entries stay whole and checked.

    Attributes
    ----------
    corrupt
        Entries found unreadable or failing their check (then removed and recomputed).
    write_errors
        Entries that could not be written; ``write_error`` is the first such error's text.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.corrupt = 0
        self.write_errors = 0
        self.write_error: str | None = None

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> tuple[dict[str, Any], float] | None:
        """The cached summary and the wall seconds its simulation took, or None (missing,
        or found damaged: then removed, and counted in :attr:`corrupt`)."""
        path = self._path(key)
        try:
            text = path.read_bytes()
        except OSError:
            return None
        try:
            entry = json.loads(text)
            summary, wall_s = entry["summary"], entry["wall_s"]
            if (entry.get("format") != ENTRY_FORMAT or entry.get("key") != key
                    or entry.get("sha256") != _payload_digest(key, summary, wall_s)
                    or not isinstance(summary, dict)):
                raise ValueError("entry fails its check")
            return summary, float(wall_s)
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            self.corrupt += 1
            path.unlink(missing_ok=True)   # best effort: recomputed and rewritten anyway
            return None

    def put(self, key: str, summary: Summary, wall_s: float) -> bool:
        """Write one entry atomically; False (and counted) when it could not be written."""
        path = self._path(key)
        tmp = temporary_beside(path)
        try:
            # Through JSON and back first, so the digest is of what a reader will parse
            # (tuples become lists, integer keys strings).
            data = json.loads(json.dumps({"summary": summary, "wall_s": wall_s}))
            entry = {"format": ENTRY_FORMAT, "key": key, **data,
                     "sha256": _payload_digest(key, data["summary"], data["wall_s"])}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, path)
        except OSError as exc:   # a full disk, a read-only folder: the sweep goes on
            self.write_errors += 1
            if self.write_error is None:
                self.write_error = f"{type(exc).__name__}: {exc}"
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        return True


def temporary_beside(path: Path) -> Path:
    """Where to write ``path`` before renaming it into place."""
    # Same folder (so os.replace is atomic), a name no other process or thread writes at
    # once (the pid alone repeats across machines sharing a network folder).
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
