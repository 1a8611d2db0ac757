"""Large results as content-addressed files under the data directory, written atomically."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from jobtrail.domain.results import ResultBytes
from jobtrail.ledger.store import Store

_CHUNK = 1024 * 1024


def data_dir(store: Store) -> Path:
    """Where large results live: $JOBTRAIL_DATA_DIR; else beside a SQLite file, with a ledger in memory (see
    :meth:`Store.results_in_memory`), or for a server in the user data dir."""
    configured = os.environ.get("JOBTRAIL_DATA_DIR")
    if configured:
        return Path(configured)
    in_memory = store.results_in_memory()
    if in_memory is not None:
        return in_memory
    if store.dialect == "sqlite" and store.engine.url.database:
        return Path(f"{store.engine.url.database}-results")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "jobtrail" / "results"


def write_atomically(directory: Path, digest: str, data: bytes | ResultBytes) -> Path:
    """The content-addressed file for ``digest``, written (streamed, fsynced, renamed into place) unless
    the same bytes are already there."""
    final = directory / digest[:2] / digest
    if final.exists() and file_digest(final) == digest:
        return final  # content-addressed: the same bytes are already there
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".incoming-")
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in (data,) if isinstance(data, bytes) else data.windows(_CHUNK, 0):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def file_digest(path: Path) -> str:
    """The sha256 of a file, read a chunk at a time."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def ledger_files(store: Store) -> tuple[list[Path], Path]:
    """The ledger's own files (a SQLite database and its journals) and its results directory."""
    files: list[Path] = []
    database = store.engine.url.database if store.dialect == "sqlite" and not store.in_memory else None
    if database:
        db = Path(database).resolve()
        files = [db, *(db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal"))]
    return files, data_dir(store).resolve()
