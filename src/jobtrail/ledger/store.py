"""The operation ledger on SQLite or PostgreSQL.

Every change is one short transaction: a conditional UPDATE of the operation
row (on its version and, under a lease, its fencing epoch) and the INSERT of
one history entry that extends the row's hash chain. The row lock taken by the
UPDATE serialises writers of one operation, so two writers can never fork a
chain; writers of different operations never wait for each other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import operator
import os
import shlex
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from jobtrail.domain.builders import builder
from jobtrail.domain.canonical import compact_json, floatless_json, request_fingerprint, to_us
from jobtrail.domain.errors import (
    ConfigError,
    JobIdTaken,
    JobtrailError,
    OperationKeyConflict,
    OperationNotFound,
    SecretInRequest,
    StaleRecord,
    StorageError,
    UsageError,
    require_extra,
)
from jobtrail.domain.evidence import Evidence, OperationCreated, StatusObservation, ValidatedResult
from jobtrail.domain.ids import new_idempotency_token, new_operation_id, new_trace_id
from jobtrail.domain.machine import check_transition
from jobtrail.domain.record import BODY_NOT_LOADED, Changes, HistoryEntry, Operation, OperationSpec
from jobtrail.domain.redact import Redactor, is_secret_name
from jobtrail.domain.states import AUTOMATIC_STATES, CREATE_PHASE, RemoteState, State
from jobtrail.ledger import schema as t
from jobtrail.ledger.chain import (
    BEFORE_FIELDS,
    ENTRY_FIELDS,
    FIXED_FIELDS,
    GENESIS,
    HASH_VERSION,
    RESULT_FIELDS,
    before_digest,
    entry_hash,
    field_digest,
    field_digests,
    observation_digest,
    seal,
    window_digest,
)
from jobtrail.ledger.migrate import holds_ledger_tables, refuse_unknown_schema

_T = TypeVar("_T")
log = logging.getLogger("jobtrail")

DEFAULT_DB_ENV = "JOBTRAIL_DB"
#: how long a SQLite writer waits for the file's write lock before it gives up with an error. Long:
#: several busy processes on one file may keep it taken most of the time (each writer of a process
#: queues on the process's lock first, see Store.writing), and a write that waits is better than a
#: submit that fails. A lock held this long by one process is a stuck process, and the error says so.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: how long a PostgreSQL statement waits for a lock another session holds before it gives up with an error,
#: as a SQLite write waits for the file's lock: a lock held this long is a stuck session (a table locked by
#: hand, a transaction left open), and the error names it, where the statement would wait without a word
POSTGRES_LOCK_TIMEOUT_MS = SQLITE_BUSY_TIMEOUT_MS
#: how long a glance (a metrics gauge's count) waits for a lock on PostgreSQL before it gives up
GLANCE_LOCK_TIMEOUT_MS = 1_000
#: how long a write is expected to wait for the lock when processes share a file (sizes a create's lease)
EXPECTED_LOCK_WAIT_S = 5.0

#: Columns a change may set besides the state (the state itself only via the machine).
MUTABLE_COLUMNS = frozenset(Changes.__annotations__)
#: the fields of a record a write can change; a write's new record shares every other with the one it was made on
WRITTEN_FIELDS = frozenset(
    {*MUTABLE_COLUMNS, "state", "partial_effects", "lease_owner", "lease_expires_at_us", "updated_at_us", "version"}
    | {"history_head"}
)


def default_db_path() -> Path:
    """``$XDG_DATA_HOME/jobtrail/jobtrail.db`` (``~/.local/share/jobtrail/jobtrail.db``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "jobtrail" / "jobtrail.db"


def _check_db_url(db: str | None) -> None:
    """A database URL that cannot even be parsed (a port that is not a number, a bracket left open) is the
    user's typo: a ConfigError in one line, never SQLAlchemy's traceback. The URL is not repeated: it may hold
    a password."""
    if db is None or "://" not in db:
        return
    try:
        sa.engine.make_url(db)
    except (ValueError, sa.exc.ArgumentError):
        raise ConfigError(
            "--db (or JOBTRAIL_DB) is not a database URL that can be read (is the port a number? is a [ left "
            "open?): write it as postgresql://HOST:PORT/DBNAME with USER@ in front of HOST (a password after the "
            "user and a colon, with an @, : or / in it percent-encoded), or give a SQLite file path"
        ) from None


def resolve_db_url(db: str | os.PathLike[str] | None = None, *, create: bool = True) -> str:
    """``--db`` wins, then ``$JOBTRAIL_DB``, then :func:`default_db_path`.

    A plain path means a SQLite file; ``postgresql://`` URLs use psycopg 3. ``create=False`` (to read, or
    only to ask): the default's directory is not made, nor a named one's required.
    """
    named = str(db) if db is not None else os.environ.get(DEFAULT_DB_ENV) or None
    raw = named or str(default_db_path())
    if raw == ":memory:":  # SQLite's own name for a database in memory, not a file in the working directory
        return "sqlite:///:memory:"
    if "://" not in raw:
        path = Path(raw).expanduser().resolve()
        if named is None:
            if create:  # the default's own directory is made on first use
                path.parent.mkdir(parents=True, exist_ok=True)
        elif create and not path.parent.is_dir():
            # a path someone gave: a typo in it must not start a new ledger in a new directory, unseen
            raise ConfigError(
                f"the directory {path.parent} for the ledger {raw} does not exist: fix the path given with --db "
                f"(or JOBTRAIL_DB), or create the directory first (mkdir -p {path.parent})"
            )
        # escaped: a path is not URL text ("a%20b.db" is that file, and "x?mode=ro.db" is not x with a query)
        return sa.engine.URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)
    _check_db_url(raw)
    scheme = raw.split("://", 1)[0]
    if scheme in ("postgres", "postgresql", "postgresql+psycopg"):
        require_extra("postgres", "a PostgreSQL database", "psycopg")
        return "postgresql+psycopg://" + raw.split("://", 1)[1]
    if scheme == "sqlite":
        return raw
    raise ConfigError(
        f"unsupported database URL scheme {scheme!r}; use a file path (SQLite) "
        "or postgresql://user@host:port/dbname (set it with --db or JOBTRAIL_DB)"
    )


def _psycopg(name: str) -> tuple[type[Exception], ...]:
    """psycopg's error class ``name``, if PostgreSQL is in use (psycopg is the optional ``postgres`` extra).

    Without psycopg imported no psycopg error can be raised, so SQLite users never import it.
    """
    module = sys.modules.get("psycopg")
    return (getattr(module, name),) if module is not None else ()


def _now_us() -> int:
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class Create:
    """Make a new record durable, with its creation entry (a submit)."""

    spec: OperationSpec
    actor: str | None = None


@dataclass(frozen=True, slots=True)
class Created:
    """A create's outcome: the record, and whether this create made it (False: its key and request
    already had it, returned as it stands)."""

    op: Operation
    new: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One write to one operation: a transition (``to`` set) or a same-state record."""

    op: Operation
    evidence: Evidence
    actor: str
    to: State | None = None
    changes: Changes = field(default_factory=Changes)
    epoch: int | None = None
    request_ids: Sequence[str] = ()
    #: the validated result this change records (its evidence a ValidatedResult of the same sha256):
    #: stored in the same transaction, so only the lease owner's own transition can store it
    result: StoredResult | None = None
    #: a second transition that continues from this one's outcome in the same write (one UPDATE, two
    #: entries): a first status answer that is already terminal moves accepted -> observing -> its ending
    then: FollowUp | None = None
    #: a worker's step under its lease: if it moves the next action ahead, it ends the lease (see
    #: _ending_the_lease_if_waiting)
    lease_ends_if_waiting: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowUp:
    """The transition a :class:`Change` continues with, by the same actor under the same lease."""

    to: State
    evidence: Evidence
    changes: Changes = field(default_factory=Changes)
    request_ids: Sequence[str] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredResult:
    """A result's row as the ledger keeps it: the bytes inline, or the path of a content-addressed file."""

    sha256: str
    size: int
    content_type: str | None
    body: bytes | None
    path: str | None
    checks: list[dict[str, Any]]
    summary: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Reschedule:
    """Update the schedule fields of ``op`` (no state change, no history entry): a poll's outcome."""

    op: Operation
    changes: Changes = field(default_factory=Changes)
    epoch: int | None = None
    #: a worker's step under its lease: if it moves the next action ahead, it ends the lease (see
    #: _ending_the_lease_if_waiting)
    lease_ends_if_waiting: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Observe:
    """One outside fact to store (redacted) as an observation."""

    operation_id: str
    kind: str
    raw: Any
    http_status: int | None = None
    provider_request_id: str | None = None
    remote_state: str | None = None
    raw_state: str | None = None
    provider_time: str | None = None
    worker: str | None = None
    lease_epoch: int | None = None
    progress: float | None = None
    next_action_at_us: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """Give up the lease on an operation (only if the lease is still ours: same epoch)."""

    operation_id: str
    epoch: int


Write = Create | Change | Reschedule | Observe | Release


@dataclass(frozen=True, slots=True)
class Moved:
    """A write that did not land: a change or reschedule whose record moved on (version or lease epoch)
    since it was read, or that would give its operation a job id another operation holds; or a create
    whose key already names a different request. The others of its batch still land; the caller raises
    :attr:`error` (or reads it again)."""

    error: StaleRecord | OperationKeyConflict | JobIdTaken


#: what one write of a batch came to, in order: :class:`Created` for a create, the new record for a
#: change or reschedule (or :class:`Moved`), the observation id for an :class:`Observe`, None for a
#: :class:`Release`
Applied = Created | Operation | Moved | int | None


class Store:
    """The ledger. Open with :meth:`Store.open`; safe to share between threads."""

    def __init__(
        self,
        engine: Engine,
        *,
        redactor: Redactor | None = None,
        clock: Callable[[], int] = _now_us,
    ) -> None:
        self.engine = engine
        self.redactor = redactor or Redactor()
        self.clock = clock
        self.dialect = engine.dialect.name
        #: (device, inode) of the SQLite file, once seen (see :meth:`check_file`)
        self._file_identity: tuple[int, int] | None = None
        #: a SQLite database in memory: one connection (see _make_engine), gone when the store closes
        self.in_memory = _in_memory(engine.url)
        #: the SQLite file, absolute: a relative path would name another file after a change of directory
        database = self.engine.url.database if self.dialect == "sqlite" and not self.in_memory else None
        self._file_path = os.path.abspath(database) if database else None
        self._write_lock = _process_write_lock(engine)
        # in memory, a read takes its turn on the one connection as a write does
        self._read_lock = self._write_lock if self.in_memory else contextlib.nullcontext()
        #: whether this thread is reading or writing (see _one_at_a_time; in memory only)
        self._busy = threading.local()
        self._memory_results: Path | None = None
        self._memory_made = False
        #: opening this store made its ledger (there was none): a command says so, a typo in --db shows
        self.made = False
        if self.in_memory:
            event.listen(engine, "do_connect", self._memory_once)
        elif self.dialect == "sqlite":
            event.listen(engine, "do_connect", self._open_existing)

    @property
    def default_clock(self) -> bool:
        """Reads the wall clock (not a test's or the simulation's own)."""
        return self.clock is _now_us

    # -- opening ----------------------------------------------------------------

    @classmethod
    def open(
        cls,
        db: str | os.PathLike[str] | None = None,
        *,
        redactor: Redactor | None = None,
        clock: Callable[[], int] = _now_us,
        migrate: bool = True,
        create: bool = True,
    ) -> Store:
        """Open (and by default create or upgrade) the ledger at ``db``. ``create=False`` (a command that only
        reads): a database that holds no ledger is refused, never given one (it may be another program's)."""
        url = resolve_db_url(db, create=create)
        engine = _make_engine(url)
        path = engine.url.database if engine.dialect.name == "sqlite" and not _in_memory(engine.url) else None
        if path and os.path.isdir(path):
            engine.dispose()
            raise UsageError(
                f"{Path(path).absolute()} is a directory, not a ledger: point --db (or JOBTRAIL_DB) at a file, "
                f"such as {Path(path).absolute() / 'jobtrail.db'}"
            )
        if not create and path and not os.path.exists(path):
            engine.dispose()
            raise UsageError(
                f"no database at {Path(path).absolute()}: there is nothing to read (none was created). "
                "Point --db (or JOBTRAIL_DB) at your ledger"
            )
        store = cls(engine, redactor=redactor, clock=clock)

        def vet(conn: Connection) -> None:
            """What the database is, asked before anything is written to it (see :meth:`_ask`)."""
            if not create and not holds_ledger_tables(conn):
                raise UsageError(
                    f"no jobtrail ledger in {shown_url(engine.url)}: there is nothing to read, and no table was "
                    "made there. Point --db (or JOBTRAIL_DB) at your ledger"
                )
            if migrate:  # (the upgrade asks again, under its lock; this one is before the store connects)
                refuse_unknown_schema(conn)

        try:
            if not create or (migrate and path and os.path.exists(path)):
                store._ask(vet)
            if migrate:
                store.migrate()
            store.check_file()
        except BaseException:
            store.close()
            raise
        return store

    @property
    def command(self) -> str:
        """``jobtrail``, as a command printed for a person to run must start to reach this ledger: with
        ``--db`` unless it is the one a bare ``jobtrail`` opens (``$JOBTRAIL_DB``, else the default). A
        command copied without it would act on another ledger (a worker would serve an empty one)."""
        here = self.engine.url.render_as_string(hide_password=False)
        try:
            bare = sa.engine.make_url(resolve_db_url(None, create=False)).render_as_string(hide_password=False)
        except JobtrailError:  # $JOBTRAIL_DB names nothing a command could open
            bare = None
        if self.in_memory or here == bare:
            return "jobtrail"
        return f"jobtrail --db {shlex.quote(shown_url(self.engine.url))}"

    def _ask(self, question: Callable[[Connection], _T]) -> _T:
        """``question`` answered without writing: the store's own SQLite connections switch the file to WAL
        mode, a change of its own to another program's database."""
        path = self.engine.url.database
        if self.dialect != "sqlite" or self.in_memory or not path:
            with self._read() as conn:
                return question(conn)
        # read-write, which never creates the file: a database in WAL mode gets its -wal and -shm files from
        # whoever opens it, and only a connection that may write removes them as it closes; read-only for a
        # file this user may only read
        uri = f"{Path(path).absolute().as_uri()}?mode={'rw' if os.access(path, os.W_OK) else 'ro'}"
        # no pool: the connection is closed (and its -wal and -shm files with it) as the question is answered
        probe = sa.create_engine(
            "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True), poolclass=sa.pool.NullPool
        )
        try:
            with self._errors("reading"), probe.connect() as conn:
                return question(conn)
        finally:
            probe.dispose()

    def migrate(self, revision: str = "head") -> None:
        """Bring the schema to ``revision``; data survives every upgrade."""
        from jobtrail.ledger.migrate import HEAD, refuse_unknown_schema, upgrade

        # a ledger at that revision already is only read, without the write lock: a reader (`ops list`,
        # `audit verify`, the dashboard) opens it while another process holds the lock, as SQLite's WAL allows
        # (asked as the upgrade asks: another program's version table is refused here too)
        try:
            with self._read() as conn:
                if refuse_unknown_schema(conn) == (HEAD if revision == "head" else revision):
                    return
        except StorageError:  # (no file yet, say): the upgrade says what is wrong, under the lock
            pass
        with self.writing("upgrading the schema") as conn:
            found = upgrade(conn, revision)
        self.made = self.made or found is None

    @property
    def file_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the SQLite file, as this store first saw it (None: PostgreSQL, in memory)."""
        return self._file_identity

    def expect_file(self, identity: tuple[int, int]) -> None:
        """Hold this store to the file another store saw (a writer process to its worker's): from now on
        :meth:`check_file` fails unless the file is that one. Raises at once if it is not there."""
        self._file_identity = identity
        self.check_file()

    def check_file(self) -> None:
        """Raise :class:`StorageError` if the SQLite file was deleted or replaced since this store first looked.

        SQLite keeps writing to an unlinked file without a word, and the next process
        would open an empty ledger: a long-running process must stop instead.
        """
        path = self._file_path
        if not path:
            return
        try:
            stat = os.stat(path)
            seen: tuple[int, int] | None = (stat.st_dev, stat.st_ino)
        except FileNotFoundError:
            seen = None
        except OSError as exc:  # (its folder's permissions changed, a network file system gone stale)
            raise StorageError(
                f"the database file {path} cannot be looked at ({exc.strerror or exc}); check the file and its "
                "folder, then start again"
            ) from exc
        if self._file_identity is None and seen is not None:
            self._file_identity = seen
            return
        if seen != self._file_identity:
            # a replacement is a deletion too: often our own pool's next connection made the new, empty file
            what = "deleted or moved away" if seen is None else "deleted or moved, and replaced by another file"
            raise StorageError(
                f"the database file {path} was {what} while this process had it open; stopping so that nothing "
                "more is written where no one will read it. Restore the file (or point --db / JOBTRAIL_DB at "
                "the right one) and start again"
            )

    def _open_existing(self, _dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
        """Once this store has seen its SQLite file, a new connection opens that file or fails: sqlite3 would
        make a missing file anew, and a process whose ledger was deleted under it would go on reading and
        writing an empty one that nobody else sees (any of its threads, before its next write noticed)."""
        if self._file_identity is None or cparams.get("uri") or not cargs:
            return
        cargs[0] = Path(os.path.abspath(cargs[0])).as_uri() + "?mode=rw"
        cparams["uri"] = True

    def _memory_once(self, *_: Any) -> None:
        """A ledger in memory lives as long as its one connection: once the store is closed, a new one would be
        another, empty ledger (SQLite's "no such table", or records that seem to have vanished)."""
        if self._memory_made:
            raise StorageError(
                "this ledger was in memory and its store is closed: its records are gone with it. Open a new "
                "store, or give a file (a path, or --db / JOBTRAIL_DB) to keep what is recorded"
            )
        self._memory_made = True

    def results_in_memory(self) -> Path | None:
        """Where a ledger in memory keeps its large results: a temporary directory of its own, removed when
        the store closes, as its records are (None: the ledger is a file or a server)."""
        if not self.in_memory:
            return None
        if self._memory_results is None:
            self._memory_results = Path(tempfile.mkdtemp(prefix="jobtrail-memory-results-"))
        return self._memory_results

    def close(self) -> None:
        self.engine.dispose()
        if self._memory_results is not None:
            shutil.rmtree(self._memory_results, ignore_errors=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            if not isinstance(exc, (sa.exc.DBAPIError, sa.exc.TimeoutError, sqlite3.Error, *_psycopg("Error"))):
                raise
            self.check_file()  # the file gone: say so, rather than SQLite's "unable to open database file"
            raise StorageError(_explain_db_error(self.engine, doing, exc)) from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._errors("reading"), self._read_lock, self._one_at_a_time():
            # a pooled connection still reads a file deleted or replaced since: what it shows is nobody's ledger
            self.check_file()
            with self.engine.connect() as conn:
                yield conn.execution_options(jobtrail_read=True)

    @contextlib.contextmanager
    def _glance(self) -> Iterator[Connection]:
        """A read that gives up soon rather than wait on a lock: a metrics scrape answers without the ledger's
        gauges instead of hanging behind a locked table (on SQLite a reader never waits on a writer)."""
        with self._read() as conn:
            if self.dialect == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(GLANCE_LOCK_TIMEOUT_MS)}")
            yield conn

    @contextlib.contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        """In memory, a read or write inside another on the same thread would get the one connection, inside
        the other's transaction: its BEGIN fails, and handing the connection back rolls the outer transaction
        back under it, so the rest of that write would commit statement by statement. Refused instead."""
        if not self.in_memory:
            yield
            return
        if getattr(self._busy, "on", False):
            raise UsageError(
                "a ledger in memory has one connection: a read or write cannot start inside another on the same "
                "thread (finish the first, or use a file)"
            )
        self._busy.on = True
        try:
            yield
        finally:
            self._busy.on = False

    @contextlib.contextmanager
    def writing(self, doing: str) -> Iterator[Connection]:
        """One write transaction (for the ledger's modules); a failure names ``doing``.

        On SQLite, the writes of one process queue here for the file's write lock, so
        at most one thread per process waits in SQLite's busy handler: that handler
        polls (up to 100 ms between tries), and many pollers starve each other past
        the busy time-out while the lock is free most of the time.
        """
        with self._errors(doing), self._write_lock, self._one_at_a_time():
            # (once this thread's turn has come) a pooled connection would write into a file deleted or replaced
            # under this process, and report success
            self.check_file()
            with self.engine.begin() as conn:
                yield conn

    # -- creating ---------------------------------------------------------------

    def create_operation(self, spec: OperationSpec, *, actor: str | None = None) -> tuple[Operation, bool]:
        """Make the record durable. Returns ``(operation, created)``.

        The same ``operation_key`` with the same request returns the existing
        operation (``created`` is False); with a different request it raises
        :class:`OperationKeyConflict`.
        """
        return self.create_operations([spec], actor=actor)[0]

    def create_operations(
        self, specs: Sequence[OperationSpec], *, actor: str | None = None
    ) -> list[tuple[Operation, bool]]:
        """Make many records durable in one transaction (one commit), as :meth:`create_operation` does.

        A key that already names a different request raises :class:`OperationKeyConflict`
        once the others are durable.
        """
        items = [Create(spec=spec, actor=actor) for spec in specs]
        try:
            outcomes = self.apply(items)
        except StorageError as exc:
            if not key_race(exc):
                raise
            outcomes = self.apply(items)  # another process inserted the same key just now: it is found this time
        return [(made.op, made.new) for made in created(outcomes)]

    @staticmethod
    def _insert_new(conn: Connection, creates: Sequence[tuple[int, Write, dict[str, Any], Any]]) -> list[Any]:
        """Insert the records of a batch's creates; a key already taken answers with its record (or a conflict).

        The keyed records are read inside the write transaction, so on SQLite (one writer) the answer
        holds; on PostgreSQL a concurrent insert of the same key makes the transaction fail on the unique
        key instead, and the caller tries again (:func:`key_race`).
        """
        ops = t.operations.c
        specs = [item.spec for _, item, _, _ in creates if isinstance(item, Create)]
        keys = {spec.operation_key for spec in specs if spec.operation_key is not None}
        taken: dict[tuple[str, str], Operation] = {}
        if keys:
            for found in conn.execute(sa.select(t.operations).where(ops.operation_key.in_(sorted(keys)))).mappings():
                taken[(found["provider"], found["operation_key"])] = _operation(found)
        outcomes: list[Any] = []
        rows: list[dict[str, Any]] = []
        entries: list[dict[str, Any]] = []
        for spec, (_, _, row, entry) in zip(specs, creates, strict=True):
            key = None if spec.operation_key is None else (spec.provider, spec.operation_key)
            existing = None if key is None else taken.get(key)
            if existing is None:
                rows.append(row)
                entries.append(entry)
                op = _operation(row)
                if key is not None:  # the same key twice in one batch: the second finds the first
                    taken[key] = op
                outcomes.append(Created(op, True))
            elif existing.request_fingerprint != row["request_fingerprint"]:
                outcomes.append(Moved(_key_conflict(spec, existing, row["request_fingerprint"])))
            else:
                outcomes.append(Created(existing, False))
        if rows:
            _RAW_INSERT_OPERATION.run_many(conn, rows)
            _RAW_INSERT_HISTORY.run_many(conn, entries)
        return outcomes

    def _new_operation(
        self, spec: OperationSpec, actor: str | None
    ) -> tuple[OperationSpec, dict[str, Any], dict[str, Any]]:
        secret_paths = self.redactor.secret_paths(spec.body)
        if secret_paths:
            raise SecretInRequest(
                f"the request body carries what looks like a credential at {', '.join(secret_paths)}; "
                "jobtrail never stores credentials: configure them on the provider "
                "(referenced by name, injected at send time) and remove them from the body",
                paths=secret_paths,
            )
        for name in ("operation_key", "caller", "approved_by"):
            text = getattr(spec, name)
            if text is not None and self.redactor.looks_like_credential(text):
                what = name.replace("_", " ")
                raise SecretInRequest(
                    f"the {what} carries what looks like a credential; jobtrail never stores credentials, and "
                    f"every listing shows the {what}: choose one without it",
                    paths=[name],
                )
        try:
            body_text = compact_json(spec.body)
        except (TypeError, ValueError) as exc:  # (orjson's errors are TypeErrors)
            raise UsageError(
                f"the request body cannot be stored as JSON ({exc}): numbers must be finite (no NaN or "
                "infinity, nothing past a 64-bit float), text valid Unicode (no lone surrogates), keys strings"
            ) from None
        fingerprint = request_fingerprint(spec.provider, spec.target, spec.endpoint, spec.body)
        now = self.clock()

        def deadline(delta: Any) -> int | None:
            return None if delta is None else now + int(delta.total_seconds() * 1_000_000)

        op_id = new_operation_id(now // 1000)
        trace_id = spec.trace_id or new_trace_id()
        genesis = OperationCreated(request_fingerprint=fingerprint, operation_key=spec.operation_key)
        row: dict[str, Any] = {
            "operation_id": op_id,
            "provider": spec.provider,
            "target": spec.target,
            "endpoint": spec.endpoint,
            "operation_key": spec.operation_key,
            "request_fingerprint": fingerprint,
            "request_body": body_text,
            "idempotency_token": new_idempotency_token(),
            "trace_id": trace_id,
            "remote_job_id": None,
            "state": State.CREATE_PENDING.value,
            "remote_state": None,
            "state_reason": None,
            "attempts": 0,
            "create_deadline_us": deadline(spec.create_deadline),
            "result_deadline_us": deadline(spec.result_deadline),
            "cancel_deadline_us": deadline(spec.cancel_deadline),
            "caller": spec.caller,
            "approved_by": spec.approved_by,
            "created_at_us": now,
            "updated_at_us": now,
            "next_action_at_us": now,
            "version": 1,
            "lease_owner": None,
            "lease_expires_at_us": None,
            "lease_epoch": 0,
            "polls": 0,
            "result_ref": None,
            "cancel_requested_by": None,
            "partial_effects": None,
        }
        # the creation entry covers every field fixed now (the token by digest only) and the first values;
        # the seal is made of some of the same digests
        digests = field_digests(row, ENTRY_FIELDS)
        row["row_seal"] = seal(row, digests)
        covers = {
            "fixed": field_digests(row, FIXED_FIELDS),
            "row": digests,
            "obs": {"after": 0, "upto": 0, "count": 0, "digest": window_digest([])},
        }
        entry = self._entry(
            operation_id=op_id,
            seq=1,
            at_us=now,
            actor=actor or spec.caller,
            from_state=None,
            to_state=State.CREATE_PENDING,
            evidence=genesis,
            remote_job_id=None,
            trace_id=trace_id,
            request_ids=(),
            fingerprint=fingerprint,
            prev_hash=GENESIS,
            covers=covers,
        )
        row["history_head"] = entry["entry_hash"]
        return spec, row, entry

    # -- changing ---------------------------------------------------------------

    def transition(
        self,
        op: Operation,
        to: State,
        evidence: Evidence,
        *,
        actor: str,
        changes: Changes | None = None,
        epoch: int | None = None,
        request_ids: Sequence[str] = (),
        result: StoredResult | None = None,
    ) -> Operation:
        """Move ``op`` to ``to`` if the state table allows it with this evidence.

        Refused transitions raise :class:`TransitionRefused` and write nothing.
        A record changed since ``op`` was read raises :class:`StaleRecord`.
        """
        return self._apply_one(
            Change(
                op=op,
                to=to,
                evidence=evidence,
                actor=actor,
                changes=changes or {},
                epoch=epoch,
                request_ids=request_ids,
                result=result,
            )
        )

    def record(
        self,
        op: Operation,
        evidence: Evidence,
        *,
        actor: str,
        changes: Changes | None = None,
        epoch: int | None = None,
        request_ids: Sequence[str] = (),
    ) -> Operation:
        """Append a history entry without changing state (a create attempt, a poll)."""
        return self._apply_one(
            Change(
                op=op,
                evidence=evidence,
                actor=actor,
                changes=changes or {},
                epoch=epoch,
                request_ids=request_ids,
            )
        )

    def _apply_one(self, change: Change) -> Operation:
        return landed(self.apply([change])[0])

    def apply(self, batch: Sequence[Write]) -> list[Applied]:
        """Apply many writes, of many operations, in one transaction (one commit, one fsync).

        Each :class:`Change` is checked by the state machine before anything is
        written; a refused change raises and nothing of the batch is written. A
        change or reschedule whose record moved on (version, or lease epoch), or a
        create whose key names a different request, comes back as :class:`Moved`
        and the others still land (see :data:`Applied`).
        """
        now = self.clock()
        prepared = [self._prepare(item, now) for item in batch]
        results: list[Applied] = [None] * len(prepared)
        slotted = [(slot, item, row, entry) for slot, (item, row, entry) in enumerate(prepared)]
        creates = [w for w in slotted if isinstance(w[1], Create)]
        others = [w for w in slotted if not isinstance(w[1], Create)]
        with self.writing("recording a transition" if others else "creating an operation") as conn:
            if others and self.dialect == "postgresql":
                _lock_in_order(conn, [item for _, item, _, _ in others])
            if creates:
                for (slot, *_), outcome in zip(creates, self._insert_new(conn, creates), strict=True):
                    results[slot] = outcome
            if others:
                self._apply_to_records(conn, others, results, now)
        for outcome in results:
            if isinstance(outcome, Created) and outcome.new:
                log.info("operation %s created (state create_pending)", outcome.op.operation_id)
        return results

    def apply_within(self, conn: Connection, batch: Sequence[Change | Reschedule | Observe]) -> list[Applied]:
        """As :meth:`apply`, in a transaction the caller holds (from :meth:`writing`) that writes something of
        its own too, all landing or none (a webhook event and its observation): the caller has locked the
        records' rows (:meth:`locked_record`)."""
        now = self.clock()
        prepared = [(slot, *self._prepare(item, now)) for slot, item in enumerate(batch)]
        results: list[Applied] = [None] * len(prepared)
        self._apply_to_records(conn, prepared, results, now)
        return results

    @staticmethod
    def locked_record(conn: Connection, operation_id: str) -> Operation:
        """The record as stored, its row locked until ``conn``'s transaction ends (on SQLite the write lock
        held already does that)."""
        ops = t.operations
        found = conn.execute(sa.select(ops).where(ops.c.operation_id == operation_id).with_for_update())
        return _operation(found.mappings().one())

    def _apply_to_records(
        self,
        conn: Connection,
        prepared: Sequence[tuple[int, Write, dict[str, Any], Any]],
        results: list[Applied],
        now: int,
    ) -> None:
        """Observations first, so an entry of the same batch covers them; then the conditional UPDATEs
        (each one's outcome says stale or not); then the history, result and release rows."""
        observations = [(slot, row) for slot, item, row, _ in prepared if isinstance(item, Observe)]
        if observations:
            ids = self._observation_ids(conn, len(observations))
            for (slot, row), observation_id in zip(observations, ids, strict=True):
                row["observation_id"] = results[slot] = observation_id
            _RAW_INSERT_OBSERVATION.run_many(conn, [row for _, row in observations])
        covered: dict[str, int] = {}
        windows = self._windows(conn, [e["operation_id"] for _, _, _, e in prepared if e is not None])
        updates = self._without_taken_job_ids(
            conn,
            [(slot, item, row, entry) for slot, item, row, entry in prepared if isinstance(item, Change | Reschedule)],
            results,
        )
        landed: set[str] | None = None
        if updates and len({u["b_operation_id"] for _, _, u, _ in updates}) == len(updates):
            # one write per operation: no entry depends on another's outcome, so every entry is
            # finished first and the UPDATEs go together (PostgreSQL: one pipelined round trip;
            # SQLite: one executemany per kind) instead of one statement each
            for _, _, update, entry in updates:
                if entry is not None:
                    self._finish_entry(conn, entry, update, covered, windows)
            rows = [update for _, _, update, _ in updates]
            landed = _update_pipelined(conn, rows) if self.dialect == "postgresql" else _update_together(conn, rows)
        history_rows: list[dict[str, Any]] = []
        result_rows: list[dict[str, Any]] = []
        for slot, item, update, entry in updates:
            assert isinstance(item, Change | Reschedule)
            if landed is None:
                if entry is not None:
                    self._finish_entry(conn, entry, update, covered, windows)
                ok = _update_statement(update["b_epoch"] is not None).run(conn, update) == 1
            else:
                ok = update["b_operation_id"] in landed
            if not ok:
                results[slot] = Moved(self._stale(conn, item))
                continue
            if entry is not None:
                history_rows.extend(_entries(entry))
                covered[entry["operation_id"]] = entry["obs_upto"]
            if isinstance(item, Change) and item.result is not None:
                result_rows.append(_result_row(item.op.operation_id, item.result, now))
            results[slot] = _advanced(item.op, update)
        if history_rows:
            _RAW_INSERT_HISTORY.run_many(conn, history_rows)
        if result_rows:
            _DELETE_RESULT.run_many(conn, [{"b_operation_id": r["operation_id"]} for r in result_rows])
            _INSERT_RESULT.run_many(conn, result_rows)
        releases = [row for _, item, row, _ in prepared if isinstance(item, Release)]
        if releases:
            _RELEASE.run_many(conn, releases)

    def _without_taken_job_ids(
        self,
        conn: Connection,
        updates: list[tuple[int, Write, dict[str, Any], Any]],
        results: list[Applied],
    ) -> list[tuple[int, Write, dict[str, Any], Any]]:
        """``updates`` but those that would give an operation a job id another operation of its provider
        holds (in the ledger, or by an earlier write of this batch): each of those comes back as
        :class:`Moved` with :class:`JobIdTaken`. One remote job is never two operations': a provider that
        answers two different requests with one job id lies about one of them, and the second request
        may never have run. On PostgreSQL, a transaction-scoped lock per job id makes two workers that
        are handed the same job id at once take turns, so the second one sees the first."""
        naming = [
            (slot, item, update)
            for slot, item, update, _ in updates
            if update["remote_job_id"] is not None
            and isinstance(item, Change | Reschedule)
            and update["remote_job_id"] != item.op.remote_job_id
        ]
        if not naming:
            return updates
        asked: dict[str, set[str]] = {}
        for _, item, update in naming:
            asked.setdefault(item.op.provider, set()).add(update["remote_job_id"])
        holders: dict[tuple[str, str], str] = {}
        for provider, job_ids in sorted(asked.items()):
            for op_id, job_id in self._job_id_holders(conn, provider, sorted(job_ids)):
                holders.setdefault((provider, job_id), op_id)
        refused: set[int] = set()
        for slot, item, update in naming:
            op_id, key = item.op.operation_id, (item.op.provider, update["remote_job_id"])
            holder = holders.setdefault(key, op_id)
            if holder != op_id:
                refused.add(slot)
                results[slot] = Moved(
                    JobIdTaken(
                        f"provider {key[0]!r} named job {key[1]!r} for operation {op_id}, but operation "
                        f"{holder} already holds that job: one remote job cannot be two operations'. The "
                        f"provider mixed up two requests (this one may never have run), or the job is "
                        f"{holder}'s; a person decides (jobtrail ops show {op_id}; jobtrail ops show {holder})",
                        operation_id=op_id,
                        holder=holder,
                        remote_job_id=key[1],
                    )
                )
        return [u for u in updates if u[0] not in refused] if refused else updates

    def _job_id_holders(self, conn: Connection, provider: str, job_ids: list[str]) -> list[tuple[str, str]]:
        """(operation id, job id) of the operations of ``provider`` that hold one of ``job_ids``."""
        found: list[tuple[str, str]] = []
        params: Any
        for start in range(0, len(job_ids), _IN_CHUNK):
            chunk = job_ids[start : start + _IN_CHUNK]
            if self.dialect == "postgresql":
                _driver_rows(
                    conn,
                    "SELECT pg_advisory_xact_lock(hashtextextended(k, 0)) "
                    "FROM (SELECT %(p)s || chr(1) || unnest(%(ids)s::text[]) AS k ORDER BY 1) AS keys",
                    {"p": provider, "ids": chunk},
                )
                sql, params = (
                    "SELECT operation_id, remote_job_id FROM operations "
                    "WHERE provider = %(p)s AND remote_job_id = ANY(%(ids)s)",
                    {"p": provider, "ids": chunk},
                )
            else:  # the only text put into it is placeholders
                sql = (
                    "SELECT operation_id, remote_job_id FROM operations "  # noqa: S608
                    f"WHERE provider = ? AND remote_job_id IN ({','.join('?' * len(chunk))})"
                )
                params = (provider, *chunk)
            found.extend((str(op_id), str(job_id)) for op_id, job_id in _driver_rows(conn, sql, params))
        return found

    def _observation_ids(self, conn: Connection, n: int) -> list[int]:
        """Ids for ``n`` new observations, ascending, taken before the rows are written: one plain
        executemany then inserts them (an INSERT ... RETURNING in parameter order costs several times
        more). SQLite: this transaction holds the write lock, and these are the ids SQLite would give
        (one above the largest); PostgreSQL: the column's own sequence."""
        if self.dialect == "postgresql":
            rows = _driver_rows(
                conn,
                "SELECT nextval(pg_get_serial_sequence('observations', 'observation_id')) "
                "FROM generate_series(1, %(n)s) ORDER BY 1",
                {"n": n},
            )
            return [int(row[0]) for row in rows]
        ((top,),) = _driver_rows(conn, "SELECT max(observation_id) FROM observations", ())
        first = int(top or 0) + 1
        return list(range(first, first + n))

    def _prepare(self, item: Write, now: int) -> tuple[Write, dict[str, Any], dict[str, Any] | None]:
        if isinstance(item, Create):
            _, row, created_entry = self._new_operation(item.spec, item.actor)
            return item, row, created_entry
        if isinstance(item, Observe):
            return item, self._observation_row(item, now), None
        if isinstance(item, Release):
            return item, {"b_operation_id": item.operation_id, "b_epoch": item.epoch}, None
        epoch = item.epoch if item.epoch is not None else (item.op.lease_epoch if item.op.lease_owner else None)
        if isinstance(item, Reschedule):
            update, _ = self._row_write(item.op, None, None, "", item.changes, (), None, epoch, now)
            return item, _ending_the_lease_if_waiting(item, update, now), None
        update, entry = self._row_write(
            item.op, item.to, item.evidence, item.actor, item.changes, item.request_ids, item.result, epoch, now
        )
        if item.result is not None:
            _check_result(item)
        then = item.then
        if then is not None:
            # the follow-up starts from the row as the first transition leaves it; its entry is hashed
            # after the first one's (_finish_entry), and one conditional UPDATE writes the row as it ends
            middle = _advanced(item.op, update)
            follow, second = self._row_write(
                middle, then.to, then.evidence, item.actor, then.changes, then.request_ids, None, epoch, now
            )
            follow["b_version"] = item.op.version
            assert entry is not None and second is not None
            entry["then"] = second
            update = follow
        return item, _ending_the_lease_if_waiting(item, update, now), entry

    def _row_write(
        self,
        op: Operation,
        to_state: State | None,
        evidence: Evidence | None,
        actor: str,
        changes: Changes,
        request_ids: Sequence[str],
        result: StoredResult | None,
        epoch: int | None,
        now: int,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The conditional UPDATE of one transition (``evidence`` set) or reschedule, and its unfinished entry."""
        bad = set(changes) - MUTABLE_COLUMNS
        if bad:
            raise UsageError(f"cannot change {', '.join(sorted(bad))} through a transition")
        to = op.state
        if evidence is None and op.state not in AUTOMATIC_STATES:
            # nothing is scheduled in a resting state, and a row changed without an entry there is
            # exactly what the audit reports as an edit
            raise UsageError(
                f"operation {op.operation_id} is {op.state.value}: nothing is scheduled in that state, "
                "so it cannot be rescheduled; record a transition instead"
            )
        if evidence is not None and to_state is not None:
            check_transition(op, to_state, evidence)
            to = to_state
        values: dict[str, Any] = {
            "remote_job_id": op.remote_job_id,
            "remote_state": op.remote_state,
            "state_reason": None if to is not op.state else op.state_reason,
            "attempts": op.attempts,
            "next_action_at_us": op.next_action_at_us,
            "polls": op.polls,
            "result_ref": op.result_ref,
            "cancel_requested_by": op.cancel_requested_by,
            "partial_effects": op.partial_effects,
            "cancel_deadline_us": op.cancel_deadline_us,
        }
        if to is not op.state:
            # entering a state decides whether anything happens automatically next,
            # and starts its request count afresh
            values["next_action_at_us"] = now if to in AUTOMATIC_STATES else None
            values["polls"] = 0
        values.update(changes)
        if to not in AUTOMATIC_STATES:
            values["next_action_at_us"] = None
        if values["state_reason"] is not None:
            values["state_reason"] = self.redactor.text(str(values["state_reason"]))
        if values["remote_state"] is not None:  # a provider's own word: it may echo a credential
            values["remote_state"] = self.redactor.text(str(values["remote_state"]))
        if values["partial_effects"] is not None:  # any JSON value, a bare string too: always encoded
            values["partial_effects"] = compact_json(self.redactor.value(values["partial_effects"]))
        update = {
            **values,
            "b_operation_id": op.operation_id,
            "b_version": op.version,
            "b_epoch": epoch,
            # nothing automatic follows a resting state: the write that enters one ends its lease too,
            # instead of a release of its own after it
            "b_release": epoch is not None and to not in AUTOMATIC_STATES,
            "state": to.value,
            "updated_at_us": now,
            "version": op.version,
            "history_head": op.history_head,
        }
        if evidence is None:
            update["row_seal"] = seal(update)
            return update, None
        # the entry covers the row as this transition writes it; the observations it covers
        # are read inside the transaction (_finish_entry), which also computes its hash
        digests = field_digests(update, ENTRY_FIELDS)
        update["row_seal"] = seal(update, digests)
        # and the columns only a transition writes as it found them: the previous entry left them so, unless
        # someone edited them since (see audit's seams)
        covers: dict[str, Any] = {
            "row": digests,
            "before": before_digest([field_digest(getattr(op, name)) for name in BEFORE_FIELDS]),
        }
        if result is not None:  # _check_result made sure the evidence names exactly these bytes
            covers["result"] = result.sha256
            # and the rest of its row, as stored: what `ops show`, `result --json` and MCP show of it
            covers["result_record"] = field_digests(_result_row(op.operation_id, result, now), RESULT_FIELDS)
        entry = self._entry(
            operation_id=op.operation_id,
            seq=op.version + 1,
            at_us=now,
            actor=actor,
            from_state=op.state,
            to_state=to,
            evidence=evidence,
            remote_job_id=values["remote_job_id"],
            trace_id=op.trace_id,
            request_ids=request_ids,
            fingerprint=op.request_fingerprint,
            prev_hash=op.history_head,
            covers=covers,
            finished=False,
        )
        update["version"] = op.version + 1
        return update, entry

    def _windows(self, conn: Connection, op_ids: Sequence[str]) -> dict[str, tuple[int | None, list[tuple[int, Any]]]]:
        """For each operation: where its last entry's coverage ends, and the observations stored since.

        One query for the whole batch (the entries' rows are locked already on PostgreSQL), its SQL
        written once: built through SQLAlchemy, each batch's IN list was a new statement to build.
        """
        if not op_ids:
            return {}
        ids = sorted(set(op_ids))
        params: Any
        if self.dialect == "postgresql":
            where, params = "o.operation_id = ANY(%(ids)s)", {"ids": ids}
        else:  # sqlite3 keeps the compiled statement for each batch size
            where, params = f"o.operation_id IN ({','.join('?' * len(ids))})", tuple(ids)
        # the only text put into it is placeholders
        sql = (
            "SELECT o.operation_id, h.obs_upto, ob.observation_id, ob.digest FROM operations AS o "  # noqa: S608
            "LEFT OUTER JOIN history AS h ON h.operation_id = o.operation_id AND h.seq = o.version "
            "LEFT OUTER JOIN observations AS ob ON ob.operation_id = o.operation_id AND ob.observation_id > h.obs_upto "
            f"WHERE {where} ORDER BY o.operation_id, ob.observation_id"
        )
        out: dict[str, tuple[int | None, list[tuple[int, Any]]]] = {}
        for op_id, upto, oid, digest in _driver_rows(conn, sql, params):
            _, items = out.setdefault(op_id, (None if upto is None else int(upto), []))
            if oid is not None:
                items.append((int(oid), digest))
        return out

    def _finish_entry(
        self,
        conn: Connection,
        entry: dict[str, Any],
        update: dict[str, Any],
        covered: dict[str, int],
        windows: dict[str, tuple[int | None, list[tuple[int, Any]]]],
    ) -> None:
        """Cover the observations stored since the previous entry, then hash the entry (inside the write)."""
        op_id = entry["operation_id"]
        after, items = windows.get(op_id, (None, []))
        if op_id in covered or after is None:
            # rare: a second entry of one operation in a batch, or the previous entry predates 0006
            # (then the operation's older observations stay uncovered)
            after = covered.get(op_id)
            if after is None:
                after = int(_LEGACY_OBSERVATIONS.fetch(conn, {"b_operation_id": op_id})[0][0] or 0)
            items = [
                (int(oid), digest)
                for oid, digest in _OBSERVATION_WINDOW.fetch(conn, {"b_operation_id": op_id, "b_after": after})
            ]
        upto = items[-1][0] if items else after
        _seal_entry(entry, after, upto, items)
        then = entry.get("then")
        if then is not None:  # a follow-up in the same write: nothing was observed between the two
            then["prev_hash"] = entry["entry_hash"]
            _seal_entry(then, upto, upto, [])
        update["history_head"] = (then or entry)["entry_hash"]

    def _stale(self, conn: Connection, change: Change | Reschedule) -> StaleRecord:
        current = conn.execute(
            sa.select(t.operations.c.version, t.operations.c.lease_epoch).where(
                t.operations.c.operation_id == change.op.operation_id
            )
        ).first()
        op_id = change.op.operation_id
        if current is None:
            return StaleRecord(f"operation {op_id} no longer exists", operation_id=op_id)
        epoch = change.epoch if change.epoch is not None else (change.op.lease_epoch if change.op.lease_owner else None)
        if epoch is not None and current.lease_epoch != epoch:
            return StaleRecord(
                f"operation {op_id}: lease epoch {epoch} is no longer current "
                f"(now {current.lease_epoch}); another worker claimed it, so this write was "
                "refused: drop the operation and let the lease owner act",
                operation_id=op_id,
                epoch=epoch,
            )
        return StaleRecord(
            f"operation {op_id} changed since it was read (version {change.op.version}, "
            f"now {current.version}); read it again and decide again",
            operation_id=op_id,
            version=change.op.version,
        )

    def _entry(
        self,
        *,
        operation_id: str,
        seq: int,
        at_us: int,
        actor: str,
        from_state: State | None,
        to_state: State,
        evidence: Evidence,
        remote_job_id: str | None,
        trace_id: str,
        request_ids: Sequence[str],
        fingerprint: str,
        prev_hash: str,
        covers: dict[str, Any],
        finished: bool = True,
    ) -> dict[str, Any]:
        redact = self.redactor
        row: dict[str, Any] = {
            "operation_id": operation_id,
            "seq": seq,
            "at_us": at_us,
            "actor": redact.text(actor),
            "from_state": None if from_state is None else from_state.value,
            "to_state": to_state.value,
            "cause": evidence.kind,
            "evidence": compact_json(redact.value(evidence.to_json())),
            "remote_job_id": remote_job_id,
            "trace_id": trace_id,
            "request_ids": floatless_json([redact.text(r) for r in request_ids]),
            "request_fingerprint": fingerprint,
            "prev_hash": prev_hash,
            "hash_version": HASH_VERSION,
            # unfinished: _finish_entry adds the observation window, then encodes and hashes
            "covers": covers,
            "obs_upto": 0,
        }
        if finished:
            row["covers"] = floatless_json(covers)
            row["entry_hash"] = entry_hash(row)
        return row

    # -- observations -------------------------------------------------------------

    def add_observation(self, operation_id: str, *, kind: str, raw: Any, **fields: Any) -> int:
        """Store one outside fact with its redacted raw response; returns its id."""
        observation_id = self.apply([Observe(operation_id=operation_id, kind=kind, raw=raw, **fields)])[0]
        assert isinstance(observation_id, int)
        return observation_id

    def _observation_row(self, item: Observe, now: int) -> dict[str, Any]:
        redact = self.redactor
        row: dict[str, Any] = {
            "operation_id": item.operation_id,
            "kind": item.kind,
            "fetched_at_us": now,
            "provider_time": item.provider_time,
            "http_status": item.http_status,
            "provider_request_id": None if item.provider_request_id is None else redact.text(item.provider_request_id),
            "remote_state": item.remote_state,
            "raw_state": None if item.raw_state is None else redact.text(item.raw_state),
            "raw": _kept_raw(redact, item),
            "worker": item.worker,
            "lease_epoch": item.lease_epoch,
            "progress": item.progress,
            "next_action_at_us": item.next_action_at_us,
        }
        row["digest"] = observation_digest(row)
        return row

    def observations(self, operation_id: str) -> list[dict[str, Any]]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(t.observations)
                .where(t.observations.c.operation_id == operation_id)
                .order_by(t.observations.c.observation_id)
            ).mappings()
            return [{**row, "raw": json.loads(row["raw"])} for row in rows]

    def observation(self, observation_id: int) -> dict[str, Any] | None:
        with self._read() as conn:
            row = (
                conn.execute(sa.select(t.observations).where(t.observations.c.observation_id == observation_id))
                .mappings()
                .first()
            )
        return None if row is None else {**row, "raw": json.loads(row["raw"])}

    # -- worker liveness -----------------------------------------------------------------------

    def heartbeat(self, worker_id: str, providers: Sequence[str], *, stopped: bool = False) -> None:
        """Record that ``worker_id`` runs and serves ``providers`` (``stopped``: it has just stopped)."""
        now = self.clock()
        served = "," + ",".join(sorted(providers)) + ","
        workers = t.workers
        with self.writing("recording a worker's heartbeat") as conn:
            changes = {"providers": served, "seen_at_us": now, "stopped_at_us": now if stopped else None}
            updated = conn.execute(sa.update(workers).where(workers.c.worker_id == worker_id).values(**changes))
            if updated.rowcount == 0:
                conn.execute(sa.insert(workers).values(worker_id=worker_id, started_at_us=now, **changes))

    def workers_for(self, provider: str) -> list[dict[str, Any]]:
        """The workers that serve ``provider``, most recently seen first (stopped ones too)."""
        workers = t.workers
        with self._read() as conn:
            rows = conn.execute(
                sa.select(workers)
                .where(workers.c.providers.contains(f",{provider},", autoescape=True))
                .order_by(workers.c.seen_at_us.desc())
                .limit(20)
            ).mappings()
            return [dict(row) for row in rows]

    def last_seen(self, operation_id: str) -> tuple[int, float | None] | None:
        """(when, progress) of the newest status read of the remote job, or None before the first."""
        obs = t.observations
        with self._read() as conn:
            row = conn.execute(
                sa.select(obs.c.fetched_at_us, obs.c.progress)
                .where(obs.c.operation_id == operation_id, obs.c.kind == "status_poll")
                .order_by(obs.c.observation_id.desc())
                .limit(1)
            ).first()
        return None if row is None else (int(row[0]), None if row[1] is None else float(row[1]))

    def count_observations(self, operation_id: str, kind: str) -> int:
        with self._read() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(t.observations)
                    .where(t.observations.c.operation_id == operation_id, t.observations.c.kind == kind)
                ).scalar_one()
            )

    # -- reading ------------------------------------------------------------------

    def get(self, operation_id: str) -> Operation:
        with self._read() as conn:
            row = (
                conn.execute(sa.select(t.operations).where(t.operations.c.operation_id == operation_id))
                .mappings()
                .first()
            )
        if row is None:
            raise OperationNotFound(
                f"no operation {operation_id!r} in this database; "
                "list them with `jobtrail ops list` (and check --db / JOBTRAIL_DB)",
                operation_id=operation_id,
            )
        return _operation(row)

    def resolve(self, ref: str, *, key_prefix: str = "") -> Operation:
        """An operation by its id, or else by its operation key (``key_prefix`` + ``ref``).

        A key used with several providers names no single operation: the error lists their ids.
        """
        try:
            return self.get(ref)
        except OperationNotFound:
            pass
        with self._read() as conn:
            rows = (
                conn.execute(
                    sa.select(t.operations)
                    .where(t.operations.c.operation_key == key_prefix + ref)
                    .order_by(t.operations.c.provider)
                    .limit(20)
                )
                .mappings()
                .all()
            )
        if len(rows) == 1:
            return _operation(rows[0])
        if rows:
            listed = ", ".join(f"{r['operation_id']} ({r['provider']})" for r in rows)
            raise UsageError(f"the key {ref!r} is used with several providers: {listed}; give the operation id")
        raise OperationNotFound(
            f"no operation has the id or key {ref!r} in this database; "
            "list them with `jobtrail ops list` (and check --db / JOBTRAIL_DB)",
            operation_id=ref,
        )

    def find_by_key(self, provider: str, operation_key: str) -> Operation | None:
        with self._read() as conn:
            row = (
                conn.execute(
                    sa.select(t.operations).where(
                        t.operations.c.provider == provider,
                        t.operations.c.operation_key == operation_key,
                    )
                )
                .mappings()
                .first()
            )
        return None if row is None else _operation(row)

    def list_operations(
        self,
        *,
        state: State | str | Sequence[State | str] | None = None,
        provider: str | None = None,
        limit: int | None = 100,
        caller: str | None = None,
        key: str | None = None,
    ) -> list[Operation]:
        """Operations, newest first, filtered by state (one or several), provider, caller and key."""
        query = _listed(sa.select(t.operations), state, provider, caller, key)
        query = query.order_by(t.operations.c.operation_id.desc())
        if limit is not None:
            query = query.limit(limit)
        with self._read() as conn:
            return [_operation(row) for row in conn.execute(query).mappings()]

    def count_operations(
        self,
        *,
        state: State | str | Sequence[State | str] | None = None,
        provider: str | None = None,
        caller: str | None = None,
        key: str | None = None,
    ) -> int:
        """How many operations :meth:`list_operations` would list without its limit."""
        query = _listed(sa.select(sa.func.count()).select_from(t.operations), state, provider, caller, key)
        with self._read() as conn:
            return int(conn.execute(query).scalar_one())

    def history(self, operation_id: str) -> list[HistoryEntry]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(t.history).where(t.history.c.operation_id == operation_id).order_by(t.history.c.seq)
            ).mappings()
            return [HistoryEntry(**row) for row in rows]

    def claim(
        self,
        worker: str,
        *,
        limit: int,
        lease_s: float,
        providers: Sequence[str] | None = None,
        states: Sequence[State] | None = None,
    ) -> list[Operation]:
        """Lease up to ``limit`` due operations (next action due, lease free or expired).

        Each claim raises the operation's fencing epoch, so writes made under an
        older lease are refused. PostgreSQL skips rows other workers are claiming.
        An operation whose next actions cannot send its request body comes without
        it (``request_body`` is :data:`BODY_NOT_LOADED`; see :func:`body_needed`).
        """
        now = self.clock()
        shape = _claim_statements(
            self.dialect,
            None if providers is None else tuple(providers),
            None if states is None else tuple(State(s).value for s in states),
        )
        if shape.probe is not None:
            # A busy worker claims every few milliseconds; taking the file's one write lock
            # to find nothing would make every other process's writes wait (a read does not)
            with self._read() as conn:
                if conn.execute(shape.probe, {"b_now": now}).first() is None:
                    return []
        params = {"b_now": now, "b_worker": worker, "b_expires": now + int(lease_s * 1_000_000)}
        rows: list[Any] = []
        with self.writing("claiming operations") as conn:
            questions = [shape.free]
            if shape.taken_over is not None and _leases_ran_out(conn, now, providers):
                questions.insert(0, shape.taken_over)
            for question in questions:
                if len(rows) >= limit:
                    break
                rows.extend(question.fetch(conn, {**params, "b_limit": limit - len(rows)}))
        # RETURNING promises no order: earliest due first, as the claim chose them
        claimed = [_claimed_operation(row) for row in rows]
        return sorted(claimed, key=lambda op: (op.next_action_at_us, op.operation_id))

    def lease(self, operation_id: str, owner: str, *, lease_s: float) -> Operation | None:
        """Lease one operation, due or not, if nobody holds a live lease on it (raising its epoch).

        Returns None while another owner's lease is live: that owner is acting
        (or about to) and nobody else may. Raises :class:`OperationNotFound`.
        """
        now = self.clock()
        ops = t.operations
        stmt = (
            sa.update(ops)
            .where(
                ops.c.operation_id == operation_id,
                sa.or_(ops.c.lease_expires_at_us.is_(None), ops.c.lease_expires_at_us <= now),
            )
            .values(
                lease_owner=owner,
                lease_expires_at_us=now + int(lease_s * 1_000_000),
                lease_epoch=ops.c.lease_epoch + 1,
            )
            .returning(*ops.c)
        )
        with self.writing("leasing an operation") as conn:
            row = conn.execute(stmt).mappings().first()
        if row is None:
            self.get(operation_id)  # raises if there is no such operation
            return None
        return _operation(row)

    def answer_to_attempt(self, operation_id: str, attempt: int) -> dict[str, Any] | None:
        """The stored answer (``create_response`` observation) to create attempt ``attempt``, or None.

        Looks at the newest few only: a late answer to an older attempt (its owner's lease
        had run out) may have been stored after the one sought.
        """
        obs = t.observations
        with self._read() as conn:
            rows = (
                conn.execute(
                    sa.select(obs)
                    .where(obs.c.operation_id == operation_id, obs.c.kind == "create_response")
                    .order_by(obs.c.observation_id.desc())
                    .limit(8)
                )
                .mappings()
                .all()
            )
        for row in rows:
            raw = json.loads(row["raw"])
            if isinstance(raw, dict) and raw.get("attempt") == attempt:
                return {**row, "raw": raw}
        return None

    def next_due_us(
        self, *, providers: Sequence[str] | None = None, states: Sequence[State] | None = None
    ) -> int | None:
        """When the earliest automatic action is due (None: nothing will happen without a person)."""
        return self._earliest(t.operations.c.next_action_at_us, _filters(providers, states))

    def next_claimable_us(
        self, *, providers: Sequence[str] | None = None, states: Sequence[State] | None = None
    ) -> int | None:
        """When a claim could next find work (None: nothing will happen without a person).

        Unlike :meth:`next_due_us`, an action due under someone's live lease counts from when that
        lease ends: an idle worker must not query in a tight loop while another worker acts.
        """
        ops = t.operations
        ready = sa.case(
            (ops.c.lease_expires_at_us > ops.c.next_action_at_us, ops.c.lease_expires_at_us),
            else_=ops.c.next_action_at_us,
        )
        where = [ops.c.next_action_at_us.is_not(None), *_filters(providers, states)]
        if self.dialect != "postgresql":  # SQLite answers from ix_operations_claim, lease and all
            return self._earliest(ready, where)
        # PostgreSQL has no index with both the due time and the lease (0012), and the one question took a
        # scan of the whole table, settled operations too, at each idle turn of every worker: asked of the
        # free operations and of the held leases apart, each is answered from its partial index (0011)
        free = sa.select(sa.func.min(ops.c.next_action_at_us)).where(ops.c.lease_owner.is_(None), *where)
        held = sa.select(sa.func.min(ready)).where(ops.c.lease_owner.is_not(None), *where)
        with self._read() as conn:  # (least() passes over a null: one of the two may have found nothing)
            value = conn.execute(sa.select(sa.func.least(free.scalar_subquery(), held.scalar_subquery()))).scalar()
        return None if value is None else int(value)

    def _earliest(self, moment: Any, where: list[Any]) -> int | None:
        with self._read() as conn:
            value = conn.execute(sa.select(sa.func.min(moment)).where(*where)).scalar()
        return None if value is None else int(value)

    def last_entry(self, operation_id: str, *, causes: Sequence[str] = ()) -> HistoryEntry | None:
        """The newest history entry (whose cause is one of ``causes``, when given)."""
        where = [t.history.c.operation_id == operation_id]
        if causes:
            where.append(t.history.c.cause.in_(list(causes)))
        with self._read() as conn:
            row = (
                conn.execute(sa.select(t.history).where(*where).order_by(t.history.c.seq.desc()).limit(1))
                .mappings()
                .first()
            )
        return None if row is None else HistoryEntry(**row)

    def count(self) -> int:
        with self._read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t.operations)).scalar_one())


def _lock_in_order(conn: Connection, writes: list[Write]) -> None:
    """PostgreSQL: lock every record a batch touches, in one order.

    An observation's id is then committed before any later entry of its operation reads the
    observations to cover (sequence order is not commit order otherwise), and batches cannot deadlock.
    """
    touched = sorted({w.operation_id if isinstance(w, Observe | Release) else w.op.operation_id for w in writes})  # type: ignore[union-attr]
    # one fixed statement with an array (an IN list of its own length would be a new statement to build each time)
    conn.exec_driver_sql(
        "SELECT operation_id FROM operations WHERE operation_id = ANY(%(ids)s) ORDER BY operation_id FOR UPDATE",
        {"ids": touched},
    ).all()


def created(outcomes: Sequence[Applied]) -> list[Created]:
    """The outcomes of a batch of creates; a key that names a different request raises its conflict
    (the others are durable by then)."""
    made: list[Created] = []
    for outcome in outcomes:
        if isinstance(outcome, Moved):
            raise outcome.error
        assert isinstance(outcome, Created)
        made.append(outcome)
    return made


def key_race(exc: StorageError) -> bool:
    """A write refused by a unique key (another process created the same operation key at that moment):
    the batch is worth trying again, each write on its own."""
    # raised through SQLAlchemy, or by the driver itself (the hot inserts run on its cursor)
    return isinstance(exc.__cause__, (sa.exc.IntegrityError, sqlite3.IntegrityError, *_psycopg("IntegrityError")))


def _key_conflict(spec: OperationSpec, existing: Operation, fingerprint: str) -> OperationKeyConflict:
    return OperationKeyConflict(
        f"operation key {spec.operation_key!r} already names {existing.operation_id} "
        f"for provider {spec.provider!r} with a different request "
        f"(fingerprint {existing.request_fingerprint[:12]}..., yours {fingerprint[:12]}...); "
        "a changed request is a new operation: submit it with a new operation key",
        operation_id=existing.operation_id,
        operation_key=spec.operation_key,
    )


def _listed(
    query: sa.Select[Any],
    state: State | str | Sequence[State | str] | None,
    provider: str | None,
    caller: str | None,
    key: str | None,
) -> sa.Select[Any]:
    ops = t.operations.c
    if state is not None:
        states = [state] if isinstance(state, State | str) else list(state)
        query = query.where(ops.state.in_([State(s).value for s in states]))
    if provider is not None:
        query = query.where(ops.provider == provider)
    if caller is not None:
        query = query.where(ops.caller == caller)
    if key is not None:
        query = query.where(ops.operation_key == key)
    return query


@dataclass(frozen=True)
class _ClaimShape:
    """A claim's statements for one set of providers and states, built once: built for each claim, they
    cost a SQLite claim of a hundred records a third of its time."""

    #: SQLite: is anything claimable at all (a read, before the write lock is taken)
    probe: sa.Select[Any] | None
    #: lease the free due operations (SQLite: the due ones whose lease ran out too); run on the driver's
    #: cursor: SQLAlchemy's rows cost a third of a claimed record's time
    free: _Prepared
    #: PostgreSQL: lease the due operations whose lease ran out
    taken_over: _Prepared | None


@functools.lru_cache(maxsize=64)
def _claim_statements(dialect: str, providers: tuple[str, ...] | None, states: tuple[str, ...] | None) -> _ClaimShape:
    """The statements of :meth:`Store.claim` (parameters ``b_now``, ``b_worker``, ``b_expires``, ``b_limit``)."""
    ops = t.operations
    now = sa.bindparam("b_now", type_=sa.BigInteger)
    filters = _filters(providers, None if states is None else [State(value) for value in states], fixed=True)

    def claimable(*lease: Any) -> sa.Select[Any]:
        return sa.select(ops.c.operation_id).where(
            ops.c.next_action_at_us <= now,
            sa.or_(ops.c.lease_expires_at_us.is_(None), ops.c.lease_expires_at_us <= now),
            *lease,
            *filters,
        )

    # the body only where an action may send it (body_needed): past the create, a claim of a thousand
    # long prompts would read, pipe and hold them all for nothing
    creating = _among(ops.c.state, sorted(s.value for s in CREATE_PHASE))
    # (no job id tested by coalesce: SQLite 3.40 answers "remote_job_id IS NULL" with 0 for a NULL in the
    # RETURNING clause of this table's UPDATE, while a SELECT answers 1)
    no_job = sa.func.coalesce(ops.c.remote_job_id, "") == ""
    body = sa.case((sa.or_(creating, no_job), ops.c.request_body), else_=sa.null())
    returned = [body.label(c.name) if c.name == "request_body" else c for c in ops.c]

    def lease(question: sa.Select[Any]) -> _Prepared:
        due = question.order_by(ops.c.next_action_at_us, ops.c.operation_id).limit(
            sa.bindparam("b_limit", type_=sa.Integer)
        )
        if dialect == "postgresql":
            due = due.with_for_update(skip_locked=True)
        return _Prepared(
            sa.update(ops)
            .where(ops.c.operation_id.in_(due.scalar_subquery()))
            .values(
                lease_owner=sa.bindparam("b_worker", type_=sa.Text),
                lease_expires_at_us=sa.bindparam("b_expires", type_=sa.BigInteger),
                lease_epoch=ops.c.lease_epoch + 1,
            )
            .returning(*returned)
        )

    if dialect == "sqlite":
        # one question: the claim index holds the lease and state, so leased rows are skipped in it
        return _ClaimShape(probe=claimable().limit(1), free=lease(claimable()), taken_over=None)
    # PostgreSQL cannot test the lease from an index it scans: the operations nobody holds and the
    # leases held each have a partial index (0011), so a claim reads no live lease on the way. Leases
    # that ran out (a worker died) are rare: probed for by provider and expiry, and taken first
    return _ClaimShape(
        probe=None,
        free=lease(claimable(ops.c.lease_owner.is_(None))),
        taken_over=lease(claimable(ops.c.lease_owner.is_not(None))),
    )


def _leases_ran_out(conn: Connection, now: int, providers: Sequence[str] | None) -> bool:
    """Does any of ``providers``' operations hold a lease past its expiry (or with none)? One probe of the
    held leases' index (0011) per provider: its first entry, the lease that runs out soonest. (Asked as a
    filter with a LIMIT, PostgreSQL expects a match early and reads the whole table instead.)"""
    ops = t.operations
    soonest = (
        sa.select(ops.c.lease_expires_at_us)
        .where(ops.c.lease_owner.is_not(None))
        .order_by(ops.c.lease_expires_at_us.asc().nulls_first())
        .limit(1)
    )
    for probe in [soonest] if providers is None else [soonest.where(ops.c.provider == p) for p in providers]:
        row = conn.execute(probe).first()
        if row is not None and (row[0] is None or row[0] <= now):
            return True
    return False


def _filters(providers: Sequence[str] | None, states: Sequence[State] | None, *, fixed: bool = False) -> list[Any]:
    """``fixed``: the lists' values fixed in the statement (see :func:`_among`)."""
    among = _among if fixed else lambda column, values: column.in_(values)
    out: list[Any] = []
    if providers is not None:
        out.append(among(t.operations.c.provider, list(providers)))
    if states is not None:
        out.append(among(t.operations.c.state, [State(s).value for s in states]))
    return out


def _among(column: sa.Column[Any], values: Sequence[str]) -> Any:
    """``column IN (values)``, each value a parameter of its own fixed in the statement: a statement run on the
    driver's cursor (see _Prepared) cannot have SQLAlchemy expand a list at each execution (and an empty list
    would still be its expanding parameter)."""
    return column.in_([sa.literal(v, sa.String) for v in values]) if values else sa.false()


def _entries(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A change's history rows: its entry, and its follow-up's if it has one."""
    then = entry.pop("then", None)
    return [entry] if then is None else [entry, then]


def _seal_entry(entry: dict[str, Any], after: int, upto: int, items: list[tuple[int, Any]]) -> None:
    """Finish an entry: the observations it covers (ids after ``after`` up to ``upto``), then its hash."""
    covers = entry["covers"]
    covers["obs"] = {"after": after, "upto": upto, "count": len(items), "digest": window_digest(items)}
    entry["covers"] = floatless_json(covers)
    entry["obs_upto"] = upto
    entry["entry_hash"] = entry_hash(entry)


def _operation(row: Any) -> Operation:
    data = dict(row)
    data.pop("row_seal", None)  # the audit's, not the record's
    data["state"] = _state(data["state"])
    body = data["request_body"]
    data["request_body"] = BODY_NOT_LOADED if body is None else json.loads(body)  # NOT NULL: None is unread
    if data.get("partial_effects") is not None:
        data["partial_effects"] = json.loads(data["partial_effects"])
    op: Operation = _from_columns(data)
    return op


#: a record from its columns by name (see builder)
_from_columns = builder(Operation, {name: f"data[{name!r}]" for name in Operation.__dataclass_fields__}, "data")


_STATES = {state.value: state for state in State}


def _state(value: str) -> State:
    """A stored state by its value (a dict lookup; State() raises for anything else, as before)."""
    return _STATES.get(value) or State(value)


def _claimed_value(name: str, at: int) -> str:
    if name == "state":
        return f"_state(row[{at}])"
    if name == "request_body":  # NOT NULL: None is a body the claim did not read
        return f"_NOT_LOADED if row[{at}] is None else _loads(row[{at}])"
    if name == "partial_effects":
        return f"None if row[{at}] is None else _loads(row[{at}])"
    return f"row[{at}]"


_COLUMN_AT = {column.name: at for at, column in enumerate(t.operations.c)}
#: a record from a claim's row (the table's columns in order), as :func:`_operation` makes it from their names
_claimed_operation = builder(
    Operation,
    {name: _claimed_value(name, _COLUMN_AT[name]) for name in Operation.__dataclass_fields__},
    "row",
    {"_state": _state, "_loads": json.loads, "_NOT_LOADED": BODY_NOT_LOADED},
)


def _ending_the_lease_if_waiting(item: Change | Reschedule, update: dict[str, Any], now: int) -> dict[str, Any]:
    """A lease holder's step that puts the operation's next action off ends the action: the worker would give
    the lease back at once, in a write of its own (a second UPDATE of the row, and on PostgreSQL a new version
    in each of its indexes). Such a write (``lease_ends_if_waiting``, set by the worker's writes) ends the
    lease itself, in the same UPDATE, as the write that enters a resting state does.

    Only a write that moves the next action, to a time ahead (or to none): one that leaves it where it was
    keeps the lease whatever the clock says (a create's attempt, a cancel's, a one-time result's count,
    each made just before its request goes out), and so does one that makes it due now (the action goes on)."""
    if item.lease_ends_if_waiting and update["b_epoch"] is not None and not update["b_release"]:
        due = update["next_action_at_us"]
        update["b_release"] = due != item.op.next_action_at_us and (due is None or due > now)
    return update


def _advanced(op: Operation, update: dict[str, Any]) -> Operation:
    """The record as ``update`` (a write that landed) leaves it."""
    effects = update["partial_effects"]
    return _advance(
        op,
        update,
        _state(update["state"]),
        None if effects is None else json.loads(effects),
        update["b_release"],
    )


def _advance_function() -> Callable[[Operation, dict[str, Any], State, Any, bool], Operation]:
    """One function setting every field (built once): every write that lands makes a record, and a dict
    of 31 fields unpacked into the constructor cost half as much again."""
    values = {}
    for name in Operation.__dataclass_fields__:
        if name == "state":
            values[name] = "state"
        elif name == "partial_effects":
            values[name] = "effects"
        elif name in ("lease_owner", "lease_expires_at_us"):  # the write that enters a resting state ends the lease
            values[name] = f"None if released else op.{name}"
        elif name in WRITTEN_FIELDS:
            values[name] = f"update[{name!r}]"
        else:
            values[name] = f"op.{name}"
    advance: Callable[[Operation, dict[str, Any], State, Any, bool], Operation] = builder(
        Operation, values, "op, update, state, effects, released"
    )
    return advance


_advance = _advance_function()


_UPDATE_VALUES = (*sorted(MUTABLE_COLUMNS), "state", "updated_at_us", "version", "history_head", "row_seal")


class _Prepared:
    """A statement compiled once per dialect and run straight on the DBAPI cursor.

    The hot writes (a record's conditional UPDATE, history INSERTs, lease
    releases) skip SQLAlchemy's per-call work; they still run inside the
    SQLAlchemy transaction, on its connection.
    """

    def __init__(self, statement: sa.Update | sa.Insert | sa.Delete | sa.Select[Any]) -> None:
        self.statement = statement
        #: an INSERT of every column of a table (see :meth:`rows_of`): its COPY and the row's values in order
        self._copy: tuple[str, Callable[[Any], tuple[Any, ...]]] | None = None
        #: per dialect: (SQL, values fixed in the statement, the parameters' values in order or None for
        #: named parameters)
        self._compiled: dict[str, tuple[str, dict[str, Any], Callable[[Any], Any] | None]] = {}

    @classmethod
    def rows_of(cls, table: sa.Table) -> _Prepared:
        """An INSERT of every column of ``table``, by name; PostgreSQL takes many rows as one COPY."""
        names = tuple(c.name for c in table.c)
        prepared = cls(sa.insert(table).values({name: sa.bindparam(name) for name in names}))
        prepared._copy = (f"COPY {table.name} ({', '.join(names)}) FROM STDIN", _in_order(names))
        return prepared

    def _args(self, conn: Connection, params: dict[str, Any]) -> tuple[str, Any]:
        entry = self._compiled.get(conn.dialect.name)
        if entry is None:
            compiled = self.statement.compile(dialect=conn.dialect)
            # learn once what SQLAlchemy's construct_params (a tenth of a write's time) adds: the
            # values written into the statement itself (``.values(lease_owner=None)``), by rendered name
            sample = compiled.construct_params(params)
            fixed = {k: v for k, v in sample.items() if k not in params}
            in_order = _in_order(tuple(compiled.positiontup)) if compiled.positiontup else None
            # published whole, in one assignment: another thread sees all of it or none of it
            entry = self._compiled[conn.dialect.name] = (compiled.string, fixed, in_order)
        sql, fixed, in_order = entry
        values = {**fixed, **params} if fixed else params
        if in_order is not None:
            return sql, in_order(values)
        return sql, values  # named parameters (psycopg): it takes the ones the statement names

    def run(self, conn: Connection, params: dict[str, Any]) -> int:
        """Execute once; returns the number of rows it touched."""
        sql, args = self._args(conn, params)
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(sql, args)
            return int(cursor.rowcount)
        finally:
            cursor.close()

    def fetch(self, conn: Connection, params: dict[str, Any]) -> list[Any]:
        """Execute a query once; returns its rows as tuples."""
        return _driver_rows(conn, *self._args(conn, params))

    def many_args(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> tuple[str, list[Any]]:
        """The SQL and the parameter sets of one executemany over ``rows``."""
        return self._args(conn, rows[0])[0], [self._args(conn, row)[1] for row in rows]

    def run_many(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            if self._copy is not None and conn.dialect.name == "postgresql":
                # an INSERT of many rows: COPY streams them in one go, where a pipelined executemany binds,
                # sends and answers each row on its own (most of a group commit's Python on PostgreSQL)
                sql, values = self._copy
                with cursor.copy(sql) as copy:
                    for row in rows:
                        copy.write_row(values(row))
            else:
                cursor.executemany(*self.many_args(conn, rows))
        finally:
            cursor.close()


#: most values one ``IN`` list of a group commit's reads holds
_IN_CHUNK = 500


def _driver_rows(conn: Connection, sql: str, params: Any) -> list[Any]:
    """The rows of ``sql`` (the driver's own placeholders), as tuples straight from the DBAPI cursor: a group
    commit's reads, without SQLAlchemy's result object and a call per row."""
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
    finally:
        cursor.close()


def _in_order(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The values of ``names`` from a mapping, as a tuple in that order (one C call per row)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda values: tuple(values[name] for name in names)


_RELEASE = _Prepared(
    sa.update(t.operations)
    .where(
        t.operations.c.operation_id == sa.bindparam("b_operation_id"),
        t.operations.c.lease_epoch == sa.bindparam("b_epoch"),
    )
    .values(lease_owner=None, lease_expires_at_us=None)
)
_OBSERVATION_WINDOW = _Prepared(
    sa.select(t.observations.c.observation_id, t.observations.c.digest)
    .where(
        t.observations.c.operation_id == sa.bindparam("b_operation_id"),
        t.observations.c.observation_id > sa.bindparam("b_after"),
    )
    .order_by(t.observations.c.observation_id)
)
_LEGACY_OBSERVATIONS = _Prepared(
    sa.select(sa.func.max(t.observations.c.observation_id)).where(
        t.observations.c.operation_id == sa.bindparam("b_operation_id"), t.observations.c.digest.is_(None)
    )
)
_DELETE_RESULT = _Prepared(sa.delete(t.results).where(t.results.c.operation_id == sa.bindparam("b_operation_id")))
_INSERT_RESULT = _Prepared(sa.insert(t.results).values({c.name: sa.bindparam(c.name) for c in t.results.c}))
_RAW_INSERT_OBSERVATION = _Prepared.rows_of(t.observations)
_RAW_INSERT_OPERATION = _Prepared.rows_of(t.operations)
_RAW_INSERT_HISTORY = _Prepared.rows_of(t.history)


def _check_result(change: Change) -> None:
    """A result is stored only by the transition that records exactly it: to succeeded with a validated
    result, or a cancelled or expired ending with the partial output it observed."""
    result, evidence = change.result, change.evidence
    assert result is not None
    named: tuple[str | None, int | None, str | None] | None
    if isinstance(evidence, ValidatedResult):
        named = (evidence.sha256, evidence.size, evidence.content_type)
        allowed = change.to is State.SUCCEEDED
    elif isinstance(evidence, StatusObservation):
        named = (evidence.partial_sha256, evidence.partial_size, evidence.partial_content_type)
        allowed = change.to in (State.CANCELLED, State.FAILED) and evidence.remote_state in (
            RemoteState.CANCELLED,
            RemoteState.EXPIRED,
        )
    else:
        named, allowed = None, False
    same = (
        named == (result.sha256, result.size, result.content_type)
        and (result.body is None) != (result.path is None)
        and (
            result.body is None
            or (len(result.body), hashlib.sha256(result.body).hexdigest()) == (result.size, result.sha256)
        )
    )
    if not allowed or not same:
        raise UsageError(
            "a result is stored only with the transition to succeeded whose ValidatedResult evidence "
            "names its sha256, size and content type (or a cancelled or expired ending whose status "
            "observation names it as partial output)"
        )


#: most characters of JSON an observation keeps of a provider's answer, and of each of its parts (see _abridged)
MAX_OBSERVED_CHARS = 64 * 1024
_MAX_PART_CHARS = 16 * 1024


def _kept_raw(redact: Redactor, item: Observe) -> str:
    """What an observation keeps of the answer: all of it, masked, up to :data:`MAX_OBSERVED_CHARS`."""
    if item.kind == "synchronous_result":
        # a result is user data: kept byte-exact (or withheld whole), never field-masked, and bounded as
        # results are (the create's answer it came in is read up to the provider's limit)
        return compact_json(redact.result_value(item.raw))
    masked = redact.answer(item.raw)
    text = compact_json(masked)
    return text if len(text) <= MAX_OBSERVED_CHARS else compact_json(_abridged(masked, text))


def _abridged(masked: Any, text: str) -> Any:
    """An answer too large to keep whole (``text``, its JSON; a provider answering each status read with
    megabytes would grow the ledger by that much a poll): its small parts as they are, each large one as its
    size and the sha256 of its masked JSON. Whatever was decided from the answer was decided on all of it."""
    if isinstance(masked, dict):
        out = {key: _part(value) for key, value in masked.items()}
        if len(compact_json(out)) <= MAX_OBSERVED_CHARS:
            return out
    return _withheld_part(text)


def _part(value: Any) -> Any:
    text = compact_json(value)
    return value if len(text) <= _MAX_PART_CHARS else _withheld_part(text)


def _withheld_part(text: str) -> dict[str, Any]:
    data = text.encode("utf-8", "surrogatepass")
    return {
        "withheld": f"too large to keep: {len(data)} bytes of JSON (an observation keeps {MAX_OBSERVED_CHARS} at most)",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _result_row(operation_id: str, result: StoredResult, now: int) -> dict[str, Any]:
    return {
        "operation_id": operation_id,
        "sha256": result.sha256,
        "size": result.size,
        "content_type": result.content_type,
        "body": result.body,
        "path": result.path,
        "checks": compact_json(result.checks),
        "summary": None if result.summary is None else compact_json(result.summary),
        "redacted": False,  # kept for the schema: results are never altered
        "stored_at_us": now,
    }


def _update_pipelined(conn: Connection, updates: list[dict[str, Any]]) -> set[str]:
    """Run the conditional UPDATEs of distinct operations pipelined (PostgreSQL); returns those that landed.

    psycopg's executemany sends every parameter set before reading any answer (one round trip), and
    RETURNING names each row that matched its version and epoch.
    """
    landed: set[str] = set()
    cursor: Any = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # psycopg's own cursor
    try:
        for fenced, group in _by_fence(updates):
            cursor.executemany(*_update_statement(fenced, returning=True).many_args(conn, group), returning=True)
            while True:
                landed.update(row[0] for row in cursor.fetchall())
                if not cursor.nextset():
                    break
    finally:
        cursor.close()
    return landed


def _by_fence(updates: list[dict[str, Any]]) -> Iterator[tuple[bool, list[dict[str, Any]]]]:
    """The UPDATEs not under a lease, then those fenced on their epoch (each kind is one statement)."""
    for fenced in (False, True):
        group = [u for u in updates if (u["b_epoch"] is not None) is fenced]
        if group:
            yield fenced, group


def _update_together(conn: Connection, updates: list[dict[str, Any]]) -> set[str]:
    """Run the conditional UPDATEs of distinct operations as one executemany per kind (SQLite); returns
    those that landed.

    SQLite's executemany reports only how many rows it changed in all. When every UPDATE matched its
    version and epoch (nearly always), that is all there is to know; when fewer did, the batch's UPDATEs
    are undone (a savepoint) and run one by one, so each one's own outcome is known.
    """
    cursor: Any = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute("SAVEPOINT jobtrail_updates")
        changed = 0
        for fenced, group in _by_fence(updates):
            cursor.executemany(*_update_statement(fenced).many_args(conn, group))
            changed += cursor.rowcount
        if changed != len(updates):
            cursor.execute("ROLLBACK TO jobtrail_updates")
        cursor.execute("RELEASE jobtrail_updates")
    finally:
        cursor.close()
    if changed == len(updates):
        return {u["b_operation_id"] for u in updates}
    return {u["b_operation_id"] for u in updates if _update_statement(u["b_epoch"] is not None).run(conn, u) == 1}


@functools.cache
def _update_statement(fenced: bool, returning: bool = False) -> _Prepared:
    """The conditional UPDATE of one record: on its version and, under a lease, its epoch."""
    stmt = (
        sa.update(t.operations)
        .where(
            t.operations.c.operation_id == sa.bindparam("b_operation_id"),
            t.operations.c.version == sa.bindparam("b_version"),
        )
        .values({name: sa.bindparam(name) for name in _UPDATE_VALUES})
        .values(
            {
                name: sa.case((sa.bindparam("b_release", type_=sa.Boolean()), sa.null()), else_=t.operations.c[name])
                for name in ("lease_owner", "lease_expires_at_us")
            }
        )
    )
    if fenced:
        stmt = stmt.where(t.operations.c.lease_epoch == sa.bindparam("b_epoch"))
    if returning:
        stmt = stmt.returning(t.operations.c.operation_id)
    return _Prepared(stmt)


_WRITE_LOCKS: dict[str, threading.RLock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _process_write_lock(engine: Engine) -> contextlib.AbstractContextManager[Any]:
    """One lock per SQLite file per process (however many stores open it), one per ledger in memory (each its own
    database); PostgreSQL needs none."""
    if engine.dialect.name != "sqlite":
        return contextlib.nullcontext()
    if _in_memory(engine.url):
        return threading.RLock()
    key = os.path.realpath(str(engine.url.database))
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(key, threading.RLock())


def in_memory(db: str | os.PathLike[str] | None) -> bool:
    """Does ``db`` (as :meth:`Store.open` takes it) name a SQLite database in memory?"""
    return _in_memory(sa.engine.make_url(resolve_db_url(db, create=False)))


def _in_memory(url: sa.URL) -> bool:
    """A SQLite database in memory (``sqlite://``, ``sqlite:///:memory:``)?"""
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        if _in_memory(sa.engine.make_url(url)):
            # SQLite gives each connection a database in memory of its own, and SQLAlchemy one connection per
            # thread: the thread that wrote and the threads that read (every async call, the worker) would each
            # see another, empty ledger ("no such table"). One connection, shared: the store takes turns on it
            engine = sa.create_engine(url, poolclass=sa.pool.StaticPool, connect_args={"check_same_thread": False})
        else:
            engine = sa.create_engine(url)
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    # Nothing is kept in the session, for a pooler in transaction mode (PgBouncer, RDS Proxy, Supavisor) hands
    # each transaction whichever server connection is free, shared with other clients: psycopg's automatic
    # prepared statements ("_pg3_1") collided there ("already exists" on every write after the first), and a
    # session's SET landed on one server connection while the next transaction ran on another.
    engine = sa.create_engine(url, pool_pre_ping=True, connect_args={"prepare_threshold": None})
    event.listen(engine, "begin", _postgres_begin)
    return engine


def _postgres_begin(conn: Connection) -> None:
    # every transaction's statements wait that long at most for a lock (SET LOCAL: the transaction's own). On
    # the driver's own cursor: the connection's options would make it a server-side cursor under yield_per
    cursor = conn.connection.cursor()
    try:
        cursor.execute(f"SET LOCAL lock_timeout = {int(POSTGRES_LOCK_TIMEOUT_MS)}")
    finally:
        cursor.close()


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    # We issue BEGIN ourselves (see _sqlite_begin): the driver's own implicit
    # transactions would start too late for a write lock taken up front.
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode = WAL")
    cursor.execute("PRAGMA synchronous = FULL")
    cursor.execute("PRAGMA secure_delete = ON")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # Writers take the write lock at BEGIN, so a writer waits (busy_timeout)
    # instead of failing when it upgrades from a read lock.
    if conn.get_execution_options().get("jobtrail_read"):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def shown_url(url: sa.engine.URL) -> str:
    """A ledger's URL as a message shows it: a SQLite file as its path, and no password, neither the
    URL's own nor one given as a query parameter (``?password=...``, ``sslpassword``, ``passfile``)."""
    if url.get_backend_name() == "sqlite":
        return url.database or "sqlite://"
    query = {k: "***" if is_secret_name(k) or "pass" in k.lower() else v for k, v in url.query.items()}
    # as a person writes it: postgresql://, not the driver this process chose (postgresql+psycopg://)
    shown = url.set(drivername=url.get_backend_name(), query=query)
    return shown.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")  # (escaped in a query)


def _explain_db_error(engine: Engine, doing: str, exc: Exception) -> str:
    where = shown_url(engine.url)
    orig = getattr(exc, "orig", None)
    text = str(orig) if orig is not None else str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "lock timeout" in text:  # PostgreSQL's lock_timeout
        hint = (
            f"another session held a lock on the ledger's tables for more than {POSTGRES_LOCK_TIMEOUT_MS / 1000:g} s;"
            " nothing was written, retry, or end the session holding it (pg_locks and pg_stat_activity show which)"
        )
    elif "locked" in text or "busy" in text:
        hint = (
            f"another process held the write lock for more than {SQLITE_BUSY_TIMEOUT_MS / 1000:g} s; "
            "nothing was written, retry, or stop the process holding the database"
        )
    elif "unable to open" in text or "No such file" in text or "readonly" in text:
        hint = "check that the path exists and is writable (set it with --db or JOBTRAIL_DB)"
    elif "Connection refused" in text or "could not connect" in text or "connection failed" in text:
        hint = "is the PostgreSQL server running and reachable? check --db / JOBTRAIL_DB"
    elif "append-only" in text:
        hint = "history entries can never be changed or deleted"
    elif isinstance(exc, (sa.exc.IntegrityError, sqlite3.IntegrityError, *_psycopg("IntegrityError"))):
        hint = "a uniqueness or reference rule refused the write; nothing was written"
    else:
        hint = "nothing was written; check the database and retry"
    return f"database error while {doing} ({where}): {first}; {hint}"


__all__ = ["Change", "Create", "Created", "Store", "created", "default_db_path", "resolve_db_url", "to_us"]


def landed(result: Applied) -> Operation:
    """The new record of a change or reschedule that landed; raises StaleRecord for one that did not."""
    if isinstance(result, Moved):
        raise result.error
    assert isinstance(result, Operation), f"not a change's outcome: {result!r}"
    return result
