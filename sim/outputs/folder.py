"""An output folder that is either complete or absent (issue 16, item 3).

Every command's ``--out DIR`` writes into a temporary folder beside ``DIR`` and puts it in
place with one rename when all its files are written: an error or an interrupt (Ctrl-C,
SIGTERM; a SIGKILL leaves only a hidden ``.fabricsim-*`` folder beside it) leaves no
half-written folder, and a folder that already holds files (a previous complete run) is
replaced only when the user says so (``--overwrite``): then the old folder is renamed aside,
the new one renamed in, and the old one deleted, so at every instant ``DIR`` is one whole run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputError(ValueError):
    """``--out`` cannot be written (one line for the user: the CLI exits 2)."""


class OutputExists(OutputError):
    """``--out`` names a folder (or file) that holds a previous result."""


def check_out(out: Path, overwrite: bool) -> Path:
    """``out`` (``~`` expanded) if a run may write it: absent, an empty folder, or anything
    with ``overwrite``; raises :class:`OutputExists` otherwise. Call it before a long
    simulation, so the refusal costs nothing.

    Examples
    --------
    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> check_out(d / "new", overwrite=False) == d / "new"
    True
    >>> _ = (d / "old").mkdir(); _ = (d / "old" / "summary.json").write_text("{}")
    >>> try:
    ...     check_out(d / "old", overwrite=False)
    ... except OutputExists as exc:
    ...     print(str(exc).split(": ", 1)[1])
    holds a previous result; pass --overwrite to replace it
    """
    out = out.expanduser()
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        what = "holds a previous result" if out.is_dir() else "is a file"
        raise OutputExists(f"--out {out}: {what}; pass --overwrite to replace it")
    # The folder beside it must take the staged copy (checked before any simulation).
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"--out {out}: cannot create {parent} "
                          f"({exc.strerror or exc})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out}: {parent} is not writable")
    return out


@contextmanager
def staged_folder(out: Path, overwrite: bool = False, prefix: str = ".fabricsim-"
                  ) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; when the block ends without an
    exception, the folder becomes ``out`` (see the module docstring); else it is removed.

    Examples
    --------
    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> with staged_folder(d / "run") as tmp:
    ...     _ = (tmp / "summary.json").write_text("{}")
    >>> sorted(p.name for p in (d / "run").iterdir())
    ['summary.json']
    """
    out = check_out(out, overwrite)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    except OSError as exc:
        raise OutputError(f"--out {out}: cannot write beside it "
                          f"({exc.strerror or exc})") from None
    try:
        try:
            yield tmp
        except OSError as exc:   # writing the outputs: a full disk, a quota
            raise OutputError(f"--out {out}: cannot write ({exc.strerror or exc}); "
                              "nothing was written") from exc
        # Checked again: another process may have written ``out`` meanwhile.
        check_out(out, overwrite)
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=prefix + "old-", dir=out.parent))
            os.replace(out, aside / out.name)
            os.replace(tmp, out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
