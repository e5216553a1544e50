"""Find shipped scenarios and topologies by name.

An installed wheel carries them under ``sim/_bundled/`` (see ``pyproject.toml``); a source
checkout has them at the repository root. Names are looked up in both, so
``fabricsim run NAME`` works from any folder either way.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]   # the sim/ package folder


def _search_dirs(kind: str) -> list[Path]:
    # Bundled copy first (installed wheel), then the checkout's top-level folder.
    return [_PACKAGE_DIR / "_bundled" / kind, _PACKAGE_DIR.parent / kind]


def resolve(kind: str, ref: str) -> Path | None:
    """Return the file for ``ref`` of ``kind`` ('scenarios' or 'topologies').

    ``ref`` may be a path (absolute or relative to the current folder) or the name of a
    shipped file, with or without the ``.yaml`` suffix. Returns None when nothing matches.

    Examples
    --------
    >>> resolve("scenarios", "llama3.2-1b-1xh200").name
    'llama3.2-1b-1xh200.yaml'
    """
    candidate = Path(ref).expanduser()
    if candidate.is_file():
        return candidate
    name = ref if ref.endswith((".yaml", ".yml")) else ref + ".yaml"
    for folder in _search_dirs(kind):
        path = folder / name
        if path.is_file():
            return path
    return None


def available(kind: str) -> list[str]:
    """Names of the shipped files of ``kind``, sorted."""
    names: set[str] = set()
    for folder in _search_dirs(kind):
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)
