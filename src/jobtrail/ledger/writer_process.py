"""A worker's group commits, prepared and written by a process of their own.

Preparing a write is Python: the state check, redaction, JSON, the hash chain.
On a thread of the worker's process it competes for the one interpreter lock
with the event loop that drives every provider call: at N = 10,000 on SQLite
the writer threads held the lock a third of the time and the loop waited. A
child process (:func:`main` of this module) runs the same
:func:`apply_group` on its own core; the worker sends each group as one pickled
message on a pipe and resumes its callers when the answer comes back, so
"durable before the send" holds exactly as on a thread: a caller wakes only
once the child has committed its write.

What the child needs travels on the pipe, never on its command line (where
``ps`` would show a database password): the ledger's URL first, then with each
group the credentials the worker's redactor learned since the last one, so the
child masks every value the worker would. The child ignores SIGINT and SIGTERM
(a worker stopping gracefully still has commits to make) and exits when the
pipe closes: when the worker closes it, or when the worker dies however it dies.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import functools
import gc
import io
import logging
import operator
import os
import pickle
import select
import signal
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import sqlalchemy as sa

from jobtrail.domain.builders import builder
from jobtrail.domain.errors import JobtrailError, StaleRecord, StorageError
from jobtrail.domain.record import BODY_NOT_LOADED, Operation
from jobtrail.domain.redact import Redactor
from jobtrail.ledger.store import (
    WRITTEN_FIELDS,
    Applied,
    Change,
    Moved,
    Release,
    Reschedule,
    Store,
    Write,
    key_race,
)

log = logging.getLogger(__name__)

#: one write's outcome from a group commit: what it came to, or the error that refused it alone
Outcome = Applied | Exception

_LENGTH = struct.Struct("<Q")
#: most writes in one transaction (a group of the worker's, and what the writer process takes together)
GROUP_MAX = 2000
#: how long closing waits for the child to finish its last commit and exit
_CLOSE_S = 30.0
#: after a failed start, how long the parent writes itself before it tries again
_RETRY_S = 30.0


def apply_group(store: Store, batch: Sequence[tuple[int, Write]]) -> tuple[list[Outcome], int]:
    """One transaction for every write of ``batch`` (``(request, write)`` pairs, a request's writes adjacent);
    if it is refused, each request on its own, so each caller gets its own answer. Returns the outcomes
    in order and the transactions committed. A failure of the database itself raises."""
    try:
        return list(store.apply([item for _, item in batch])), 1
    except StorageError as exc:
        # the database itself failed (locked past its time-out, gone): every caller hears it at once;
        # a key another process took just now is one request's business, found when it runs alone
        if not key_race(exc):
            raise
    except Exception as exc:
        # one refused write (a transition without its evidence) must not fail its neighbours
        log.debug("group commit of %d writes refused (%s): each request on its own", len(batch), exc)
    requests: dict[int, list[Write]] = {}
    for request, item in batch:
        requests.setdefault(request, []).append(item)
    outcomes: list[Outcome] = []
    transactions = 0
    for items in requests.values():  # in queue order: a request's writes are adjacent in the batch
        try:
            outcomes.extend(store.apply(items))
            transactions += 1
        except Exception as exc:
            outcomes.extend([exc] * len(items))
    return outcomes, transactions


#: per record class, its fields' names, and a function that reads their values as a tuple (see _Pickler)
_FIELDS: dict[type, tuple[str, ...]] = {}
_VALUES: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def _fields_of(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _values_of(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    names = _fields_of(cls)
    if len(names) == 1:  # attrgetter of one name gives the value, not a tuple
        (name,) = names
        _VALUES[cls] = lambda obj: (getattr(obj, name),)
    else:
        _VALUES[cls] = operator.attrgetter(*names)
    return _VALUES[cls]


#: classes found not to be records (functions, classes, exceptions...): pickle's own way, without asking again
_PICKLED_AS_USUAL: set[type] = set()

#: per record class, a function that makes one from its fields' values (see _maker)
_MAKERS: dict[type, Callable[[tuple[Any, ...]], Any]] = {}


def _maker(cls: type) -> Callable[[tuple[Any, ...]], Any]:
    """A record of ``cls`` from its fields' values, as its ``__init__`` would set them (see :func:`builder`)."""
    make: Callable[[tuple[Any, ...]], Any] = builder(
        cls, {name: f"v[{i}]" for i, name in enumerate(_fields_of(cls))}, "v"
    )
    _MAKERS[cls] = make
    return make


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    return (_MAKERS.get(cls) or _maker(cls))(values)


class _Pickler(pickle.Pickler):
    """Records (frozen dataclasses with slots: operations, writes, evidence) as their class and a tuple of
    their fields: pickle's own way for them asks :func:`dataclasses.fields` twice per object, which cost
    more than the rest of a group's message."""

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        values = _VALUES.get(cls)
        if values is None:
            if cls in _PICKLED_AS_USUAL:
                return NotImplemented
            if isinstance(obj, enum.Enum):  # by name, found with getattr: not the enum's call by value
                return getattr, (cls, obj.name)
            if not (dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__")) or isinstance(obj, type):
                _PICKLED_AS_USUAL.add(cls)  # (the answer depends on the class alone)
                return NotImplemented
            values = _values_of(cls)
        return _rebuild, (cls, values(obj))


class _NotSent:
    """Stands in for an operation's request body in the writer process (see :class:`_ToChild`)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "NOT_SENT"

    def __repr__(self) -> str:
        return "<request body not sent to the writer process>"


NOT_SENT = _NotSent()


class _ToChild(_Pickler):
    """What the worker sends its writer process: an operation without its request body, or only its name.

    Nothing the child writes reads a record's body (it is fixed when the record is made, and a
    :class:`Create` carries its own), and a body may be megabytes: sent with every write of the
    operation it would be pickled, piped and unpickled some eight times over. The child answers a
    write with what changed (:class:`_Delta`), so the worker's record keeps its own body.

    And a record the child itself answered with (``held``: see :class:`_Held`) is not sent again:
    a write made on that very record names it, and the child takes its own copy. Most of a
    worker's writes are made on the record its last write or claim came back with.
    """

    def __init__(self, file: IO[bytes], protocol: int, held: _Held | None = None) -> None:
        super().__init__(file, protocol=protocol)
        self._held = held

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is Operation:
            serial = 0 if self._held is None else self._held.serial_of(obj)
            if serial:
                return _held_record, (obj.operation_id, serial)
            values = _OPERATION_VALUES(obj)
            return _rebuild, (Operation, (*values[:_BODY], NOT_SENT, *values[_BODY + 1 :]))
        return super().reducer_override(obj)


class _Held:
    """The records the writer process answered with, one per operation while a lease holds it, each
    under a serial number the child gives it and sends with its answer: the child keeps the records,
    the worker the very objects it made of those answers.

    The worker names a record only if the write was made on that object; the child takes its own
    copy if it still holds that serial, and otherwise (a later answer on the same operation replaced
    it: the write was made on a record that moved on) refuses the write as stale (see :class:`_Gone`).
    A record with no lease, or that a write refused, is let go on both ends. Each end forgets its
    oldest records past a bound, the child's four times the worker's: both update in the order of
    the answers, so what the child forgets the worker forgot long before, and never names.
    """

    def __init__(self, most: int) -> None:
        self._most = most
        self._serial = 0
        #: operation id -> (serial, record), oldest first
        self.records: dict[str, tuple[int, Operation]] = {}

    def serial_of(self, op: Operation) -> int:
        """The serial ``op`` was answered with, if this is the record held (0: send it whole)."""
        held = self.records.get(op.operation_id)
        return held[0] if held is not None and held[1] is op else 0

    def keep(self, op_id: str, record: Operation | None) -> int:
        """The child: number and hold ``record`` if a lease holds it, else let its operation go (0)."""
        if record is None or record.lease_owner is None:
            self.records.pop(op_id, None)
            return 0
        self._serial += 1
        self._put(op_id, self._serial, record)
        return self._serial

    def follow(self, op_id: str, record: Operation | None, serial: int) -> None:
        """The worker: hold ``record`` under the serial the child answered with (0: it let the operation go)."""
        if serial and record is not None:
            self._put(op_id, serial, record)
        else:
            self.records.pop(op_id, None)

    def let_go(self, batch: Sequence[tuple[int, Write]]) -> None:
        """Both ends: let go of the operations ``batch`` wrote (its call failed as a whole)."""
        for _, item in batch:
            op_id = _written_op_id(item)
            if op_id is not None:
                self.records.pop(op_id, None)

    def _put(self, op_id: str, serial: int, record: Operation) -> None:
        records = self.records
        records.pop(op_id, None)  # (to the end: the oldest go first)
        records[op_id] = (serial, record)
        while len(records) > self._most:  # leases given up without a write through here (rare)
            del records[next(iter(records))]


#: most records each end holds (the child's four times the worker's; a worker's actions in flight are far fewer)
_WORKER_MOST = 50_000
_CHILD_MOST = 4 * _WORKER_MOST


class _Gone:
    """Stands in, in the child, for a record the worker named that the child no longer holds."""

    __slots__ = ("operation_id",)

    def __init__(self, operation_id: str) -> None:
        self.operation_id = operation_id


def _held_record(operation_id: str, serial: int) -> Operation | _Gone:
    """In the child, unpickling a write: the record named, as it answered with it. (Looked up as the
    message is read: a write read with an earlier one on the same record gets that record, and the
    database decides, as it would on the record sent whole.)"""
    held = _HELD.records.get(operation_id)
    return held[1] if held is not None and held[0] == serial else _Gone(operation_id)


def _written_op_id(item: Write) -> str | None:
    """The operation whose record a write replaces (None: an observation or a create)."""
    if isinstance(item, Change | Reschedule):
        return item.op.operation_id
    if isinstance(item, Release):
        return item.operation_id
    return None


_BODY = _fields_of(Operation).index("request_body")
#: an operation's fields' values, in order (what _ToChild sends and _Delta compares)
_OPERATION_VALUES = _values_of(Operation)
#: where the fields a write can change are among them, and their values
_WRITTEN = tuple(i for i, name in enumerate(_fields_of(Operation)) if name in WRITTEN_FIELDS)
_WRITTEN_VALUES = operator.attrgetter(*(_fields_of(Operation)[i] for i in _WRITTEN))


@dataclasses.dataclass(frozen=True, slots=True)
class _Delta:
    """A write's new record, as the fields it changed in the record the write was made on (by index):
    a few values back over the pipe instead of the whole record, its request body included."""

    changes: tuple[tuple[int, Any], ...]
    #: the serial the child holds the new record under (0: it let the operation go; see _Held)
    serial: int = 0

    @classmethod
    def between(cls, before: Operation, after: Operation, serial: int = 0) -> _Delta:
        values = zip(_WRITTEN, _WRITTEN_VALUES(before), _WRITTEN_VALUES(after), strict=True)
        # only the fields a write can change; and one it leaves alone is the very same object: most are
        # ruled out without a call
        return cls(tuple([(i, new) for i, old, new in values if new is not old and _differs(old, new)]), serial)

    def applied_to(self, op: Operation) -> Operation:
        values = list(_OPERATION_VALUES(op))
        for i, value in self.changes:
            values[i] = value
        if values[_BODY] is NOT_SENT:  # the child made a new record of its own: a bug, never stored
            raise StorageError("the writer process answered with a record without its request body")
        op = _rebuild(Operation, tuple(values))
        assert isinstance(op, Operation)
        return op


def _differs(old: Any, new: Any) -> bool:
    """Must ``new`` be sent? Equal is not the same: ``1 == 1.0 == True``, also inside a JSON value (partial
    effects), where the stored value would come back with the other type."""
    if new is old:
        return False
    if type(new) is not type(old) or isinstance(new, dict | list):
        return True
    return bool(new != old)


def _answers(
    batch: Sequence[tuple[int, Write]], outcomes: list[Outcome], serials: Sequence[int]
) -> list[Outcome | _Delta]:
    """The child's answers: a change's or reschedule's new record as a :class:`_Delta` of its old one."""
    return [
        _Delta.between(item.op, outcome, serial)
        if isinstance(outcome, Operation) and isinstance(item, Change | Reschedule)
        else outcome
        for (_, item), outcome, serial in zip(batch, outcomes, serials, strict=True)
    ]


def _message(message: Any, pickler: Callable[..., _Pickler] = _Pickler) -> bytes:
    buffer = io.BytesIO()
    buffer.write(bytes(_LENGTH.size))
    pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    data = buffer.getbuffer()
    _LENGTH.pack_into(data, 0, len(data) - _LENGTH.size)
    return bytes(data)


def _send(fd: int, *messages: Any) -> None:
    """Messages on the pipe at ``fd``, whole: the child's answers (see :func:`_write_all`)."""
    _write_all(fd, b"".join(_message(m) for m in messages))


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` on ``fd``, or an error. A write to a pipe that a signal interrupts once it has
    begun (a stop by a debugger, a profiler or SIGSTOP) takes only part of it; the rest must follow, or no
    answer after it can be read. ``sys.stdout.buffer`` does not see to that when it is the raw file (under
    PYTHONUNBUFFERED=1, which many container images set, or ``python -u``): it returns the count and
    drops the rest."""
    with memoryview(data) as view:
        sent = 0
        while sent < len(view):
            sent += os.write(fd, view[sent:])


def _portable(outcomes: list[Outcome]) -> list[Outcome]:
    """Outcomes as they can cross the pipe: an error that does not pickle goes as its message."""
    return [_portable_error(o) if isinstance(o, Exception) else o for o in outcomes]


def _portable_error(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))  # noqa: S301 - our own bytes
    except Exception:
        return StorageError(f"{type(exc).__name__}: {exc}")
    return exc


class WriterProcess:
    """The parent's end, on the event loop: each call is one message on the child's pipe, its answer the
    next answer to come back (the child answers in order). Nothing waits on a thread, so nothing of it
    competes with the loop for the interpreter lock.

    The child starts in the background (:meth:`start_soon`); until it is :attr:`ready`, and whenever it
    is not (it died, it could not start), the caller writes in its own process as before.
    """

    def __init__(self, url: str, redactor: Redactor, file_identity: tuple[int, int] | None = None) -> None:
        self._url = url
        self._file_identity = file_identity
        self._redactor = redactor
        self._proc: asyncio.subprocess.Process | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: collections.deque[_Waiting] = collections.deque()
        #: the records the running child holds for this worker (a new child holds none)
        self._held = _Held(_WORKER_MOST)
        self._reader: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._sent = 0  # the redactor's values the child has

    @classmethod
    def for_store(cls, store: Store) -> WriterProcess | None:
        """A writer process for ``store``, or None when another process cannot write for it: an in-memory
        SQLite ledger, a store on a clock of its own (tests, the simulation) or with writes of its own."""
        if type(store).apply is not Store.apply or not store.default_clock:
            return None
        if store.in_memory:
            return None
        url = store.engine.url.render_as_string(hide_password=False)
        return cls(url, store.redactor, store.file_identity)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def ready(self) -> bool:
        """The child runs, for this event loop: calls go to it."""
        return self._proc is not None and self._loop is asyncio.get_running_loop()

    def start_soon(self) -> None:
        """Start the child in the background, unless it runs, is starting, or failed to start just now."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new loop: what ran on the last one (closed) cannot be reached
            self._forget()
            self._loop = loop
        if self._proc is not None or (self._starting is not None and not self._starting.done()):
            return
        if time.monotonic() < self._retry_at:
            return
        self._starting = loop.create_task(self._begin())

    def _forget(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, RuntimeError):  # its loop may be closed
                self._proc.kill()
        self._proc, self._reader, self._starting, self._waiting = None, None, None, collections.deque()

    async def _begin(self) -> None:
        try:
            proc = await self._start()
        except (JobtrailError, OSError) as exc:
            self._retry_at = time.monotonic() + _RETRY_S
            log.warning("the ledger's writer process did not start (%s); this process writes itself meanwhile", exc)
            return
        # each child answers the calls made to it: a successor's calls wait in a queue of their own
        self._proc, self._sent, self._waiting, self._held = proc, 0, collections.deque(), _Held(_WORKER_MOST)
        self._reader = asyncio.get_running_loop().create_task(self._read(proc, self._waiting, self._held))

    def post(self, batch: Sequence[tuple[int, Write]]) -> Awaitable[tuple[list[Outcome], int]]:
        """What :func:`apply_group` returns, from the child (a database failure raises as it would here), its
        group on the pipe before this returns: the caller may send the next group while the child commits this
        one (the child takes the groups that have arrived together)."""
        batch = list(batch)
        return self._answer(self._post("apply_group", (batch,), {}, batch))

    async def claim(self, worker_id: str, **kwargs: Any) -> list[Operation]:
        """:meth:`Store.claim`, in the child: a claim queues with the commits instead of polling for the
        SQLite file's lock against them."""
        claimed: list[Operation] = await self._answer(self._post("claim", (worker_id,), kwargs))
        return claimed

    def _post(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], batch: list[tuple[int, Write]] | None = None
    ) -> asyncio.Future[Any]:
        """Put one call on the pipe (now, not when awaited); its answer comes to the future returned."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise StorageError("the ledger's writer process is not running; the write was not sent")
        values = self._redactor.registered()
        data = _message((values[self._sent :], method, args, kwargs), functools.partial(_ToChild, held=self._held))
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        proc.stdin.write(data)  # before it waits: a call that could not be sent must not take another's answer
        self._sent = len(values)  # (nor count as having sent the child the credentials it carried)
        self._waiting.append(
            _Waiting(answer, method, batch)
        )  # (before its answer can be read: the reader runs on this loop too)
        return answer

    @staticmethod
    async def _answer(answer: asyncio.Future[Any]) -> Any:
        kind, value = await answer
        if kind == "raised":
            raise value
        return value

    async def _start(self) -> asyncio.subprocess.Process:
        package_root = str(Path(__file__).resolve().parents[2])  # where this jobtrail is imported from
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        proc = await asyncio.create_subprocess_exec(
            # imported, not run as __main__: what it pickles must name this module
            *(sys.executable, "-c", "from jobtrail.ledger.writer_process import main; main()"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(_message((self._url, self._file_identity)))
        try:
            kind, value = await _read_one(proc.stdout)
        except (asyncio.IncompleteReadError, OSError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            code = await proc.wait()
            raise StorageError(
                f"the ledger's writer process could not start (status {code}); its error is on this process's "
                f"standard error. Check that `{sys.executable}` can import jobtrail"
            ) from exc
        if kind == "raised":
            await proc.wait()
            raise value
        return proc

    async def _read(self, proc: asyncio.subprocess.Process, waiting: collections.deque[_Waiting], held: _Held) -> None:
        """Hand each answer to the oldest call waiting; if the child dies, every call waiting hears it.

        A group's answer becomes its outcomes here, and both this end and the child learn from it which
        records the child holds, answer by answer, in the order the child gave them (see :class:`_Held`)."""
        assert proc.stdout is not None
        garbled = None
        try:
            while True:
                answer = await _read_one(proc.stdout)
                caller = waiting.popleft()
                try:
                    answer = caller.followed(answer, held)
                except Exception as exc:  # a bug here must fail its own caller, not leave it waiting
                    held.let_go(caller.batch or ())
                    answer = ("raised", StorageError(f"the writer process's answer could not be read: {exc!r}"))
                if not caller.future.done():  # (cancelled: its loop is closing)
                    caller.future.set_result(answer)
        except (asyncio.IncompleteReadError, OSError):
            pass
        except Exception as exc:  # bytes that are no answer: nothing after them can be matched to a call
            garbled = exc
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if self._proc is proc:
            self._proc = None
        code = await proc.wait()
        if garbled is not None:
            log.error(
                "the ledger's writer process (pid %d) sent bytes that are no answer (%s: %s); it was stopped",
                *(proc.pid, type(garbled).__name__, garbled),
            )
            why = f"sent bytes that are no answer ({type(garbled).__name__}) and was stopped"
        else:
            why = f"exited with status {code}"
        for caller in waiting:
            if not caller.future.done():
                caller.future.set_exception(
                    StorageError(
                        f"the ledger's writer process (pid {proc.pid}) {why}; what it was writing is not "
                        "confirmed. It starts again at the next write; its error, if any, is on this process's "
                        "standard error"
                    )
                )

    async def close(self) -> None:
        """Let the child finish what it was sent, then exit (its pipe closed, it has no work left)."""
        if self._starting is not None:
            await self._starting
        proc, reader, self._proc, self._starting = self._proc, self._reader, None, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), _CLOSE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if reader is not None:
            await reader


class _Waiting(NamedTuple):
    """A call on the pipe, waiting for its answer."""

    future: asyncio.Future[Any]
    method: str
    #: a group's writes (to make its outcomes of the answer)
    batch: list[tuple[int, Write]] | None

    def followed(self, answer: tuple[str, Any], held: _Held) -> tuple[str, Any]:
        """The answer as its caller takes it (a group's: its outcomes; a claim's: its records), once
        ``held`` has followed it."""
        kind, value = answer
        batch = self.batch
        if kind != "done":
            held.let_go(batch or ())
            return answer
        if batch is None:
            if self.method != "claim":
                return answer
            records, serials = value
            for op, serial in zip(records, serials, strict=True):
                held.follow(op.operation_id, op, serial)
            return kind, records
        answers, transactions = value
        outcomes = []
        for (_, item), reply in zip(batch, answers, strict=True):
            outcome = _outcome(item, reply)
            outcomes.append(outcome)
            op_id = _written_op_id(item)
            if op_id is not None:
                record = outcome if isinstance(outcome, Operation) else None
                held.follow(op_id, record, reply.serial if isinstance(reply, _Delta) else 0)
        return kind, (outcomes, transactions)


def _outcome(item: Write, reply: Any) -> Any:
    """A write's outcome from the child's reply: a change's or reschedule's new record, made of its own."""
    if not (isinstance(reply, _Delta) and isinstance(item, Change | Reschedule)):
        return reply
    try:
        return reply.applied_to(item.op)
    except StorageError as exc:
        return exc


async def _read_one(stream: asyncio.StreamReader) -> Any:
    (size,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
    return pickle.loads(await stream.readexactly(size))  # noqa: S301 - our own child, on our own pipe


def _open(url: str, identity: tuple[int, int] | None) -> Store:
    """The worker's ledger, the very file it opened: a SQLite file deleted (or replaced) since is not
    made anew here, where nobody would read what is written to it."""
    path = sa.engine.make_url(url).database if identity is not None else None
    if path is not None and not os.path.exists(path):
        raise StorageError(f"the database file {path} was deleted or moved away while the worker had it open")
    store = Store.open(url, migrate=False)
    if identity is not None:
        store.expect_file(identity)
    return store


class _Calls:
    """The child's end of the pipe, read from its descriptor: the next message (waiting for it), and the
    whole messages that have arrived since, so that the groups sent while one was committed are committed
    together, in one transaction."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()
        self._at = 0  # where the first message not yet taken starts
        self._closed = False

    def next(self) -> Any:
        """The next message; EOFError once the pipe is closed and every whole message was taken."""
        while True:
            message = self.take()
            if message is not _NOTHING:
                return message
            if self._closed or not self._read():
                raise EOFError

    def take(self) -> Any:
        """The next whole message already read, or _NOTHING."""
        start = self._at + _LENGTH.size
        if len(self._buffer) < start:
            return _NOTHING
        (size,) = _LENGTH.unpack_from(self._buffer, self._at)
        if len(self._buffer) < start + size:
            return _NOTHING
        self._at = start + size
        with memoryview(self._buffer) as view:
            return pickle.loads(view[start : start + size])  # noqa: S301 - our own parent's message, on our pipe

    def fill(self, wait: float) -> bool:
        """Read what has arrived, after waiting at most ``wait`` seconds for something to; False if nothing
        came. (Where a pipe cannot be polled, Windows, only what one read brought is taken together.)"""
        if self._closed or not _POLLABLE or not select.select([self._fd], [], [], max(wait, 0.0))[0]:
            return False
        return self._read()

    def _read(self) -> bool:
        chunk = os.read(self._fd, _READ_SIZE)
        if not chunk:
            self._closed = True
            return False
        if self._at > len(self._buffer) // 2:  # what was taken goes, not at every message (that is quadratic)
            del self._buffer[: self._at]
            self._at = 0
        self._buffer += chunk
        return True


_NOTHING = object()
#: select() polls pipes everywhere but on Windows (sockets only there)
_POLLABLE = os.name != "nt"
#: under load, a writer process starts a transaction at most this often (see _gather)
_COMMIT_EVERY_S = 0.08
#: a transaction of at least this many writes is load: the next one waits for company (see _company_until)
_COMPANY = 8
#: most bytes one read of the pipe takes
_READ_SIZE = 1 << 20


def _gather(calls: _Calls, until: float) -> list[Any]:
    """The next message and those that join its transaction: the whole messages that have arrived, and,
    until the monotonic time ``until`` (see :func:`_company_until`), those that arrive meanwhile. Not past
    a claim (the worker waits on it to act), nor past ``GROUP_MAX`` writes (the rest stay read for the
    next transaction)."""
    pending = [calls.next()]
    while _waits(pending):
        message = calls.take()
        if message is not _NOTHING:
            pending.append(message)
        elif not calls.fill(until - time.monotonic()):
            break
    return pending


def _company_until(pending: list[Any], started: float) -> float:
    """Until when the next transaction waits for more writes to join it, given the last one's messages and
    when it started. Under load (few connections to the provider trickle writes in, a transaction each would
    be hundreds a second) the next one waits until ``_COMMIT_EVERY_S`` after this one started: fewer,
    larger commits, each write waiting that long at most. Writes that come alone (one operation's steps, one
    after another) wait for nobody: a lone job's life cycle is not paced. (PostgreSQL's ``commit_delay``
    waits only when ``commit_siblings`` transactions are active, for the same reason.)"""
    return started + _COMMIT_EVERY_S if _writes(pending) >= _COMPANY else 0.0


def _waits(calls: list[Any]) -> bool:
    """May more messages join these in one transaction?"""
    if any(method != "apply_group" for _, method, _, _ in calls):
        return False
    return _writes(calls) < GROUP_MAX


def _writes(calls: list[Any]) -> int:
    """How many writes the groups among ``calls`` hold."""
    return sum(len(args[0]) for _, method, args, _ in calls if method == "apply_group")


def _runs(calls: list[Any]) -> list[list[Any]]:
    """Calls in order, those that follow each other to the same method in one run (a claim stands alone)."""
    runs: list[list[Any]] = []
    for call in calls:
        if runs and call[1] == "apply_group" and runs[-1][0][1] == "apply_group":
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs


def _serve(store: Store, run: list[Any], held: _Held | None = None) -> list[tuple[str, Any]]:
    """One answer per call of ``run``: a claim; or groups committed as one (the first answer counts the
    transactions), each group's outcomes in its own answer. ``held`` follows the records answered with."""
    held = held or _Held(_CHILD_MOST)
    for values, *_ in run:
        for value in values:
            store.redactor.register(value)
    _, method, args, kwargs = run[0]
    batch: list[tuple[int, Write]] = []
    try:
        if method == "claim":
            claimed = store.claim(*args, **kwargs)
            return [("done", (claimed, [held.keep(op.operation_id, _without_body(op)) for op in claimed]))]
        if method != "apply_group":
            raise StorageError(f"the writer process has no call {method!r}")
        batch = [write for _, _, (group,), _ in run for write in group]
        outcomes, transactions = _apply_held(store, batch)
        serials = [
            0 if op_id is None else held.keep(op_id, _without_body(o) if isinstance(o, Operation) else None)
            for o, op_id in zip(outcomes, (_written_op_id(item) for _, item in batch), strict=True)
        ]
        answers = _answers(batch, _portable(outcomes), serials)
    except Exception as exc:
        held.let_go(batch)  # the whole run failed: its operations are let go, as the worker lets them go
        error = ("raised", _portable_error(exc))
        return [error] * len(run)
    out: list[tuple[str, Any]] = []
    at = 0
    for _, _, (group,), _ in run:
        out.append(("done", (answers[at : at + len(group)], transactions)))
        at += len(group)
        transactions = 0
    return out


def _apply_held(store: Store, batch: list[tuple[int, Write]]) -> tuple[list[Outcome], int]:
    """:func:`apply_group`, but a write made on a record the worker named and this child no longer holds
    (a later answer replaced it: the record moved on) is refused as stale, as the database would refuse it."""
    gone = {
        i: op.operation_id for i, (_, item) in enumerate(batch) if isinstance(op := getattr(item, "op", None), _Gone)
    }
    if not gone:
        return apply_group(store, batch)
    live = [write for i, write in enumerate(batch) if i not in gone]
    outcomes, transactions = apply_group(store, live) if live else ([], 0)
    landed = iter(outcomes)
    return [_moved_on(gone[i]) if i in gone else next(landed) for i in range(len(batch))], transactions


def _moved_on(operation_id: str) -> Moved:
    return Moved(
        StaleRecord(
            f"operation {operation_id} changed since it was read; read it again and decide again",
            operation_id=operation_id,
        )
    )


def _without_body(op: Operation) -> Operation:
    """A record as the child keeps it: no write it makes reads the body (see :class:`_ToChild`)."""
    if op.request_body is NOT_SENT or op.request_body is BODY_NOT_LOADED:
        return op
    values = _OPERATION_VALUES(op)
    record = _rebuild(Operation, (*values[:_BODY], NOT_SENT, *values[_BODY + 1 :]))
    assert isinstance(record, Operation)
    return record


def main() -> None:
    """The child: open the ledger, then commit the groups that arrive until the pipe closes."""
    # a Ctrl-C or a service manager's SIGTERM reaches the whole group; the worker decides when this ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    calls, out = _Calls(sys.stdin.fileno()), sys.stdout.fileno()
    sys.stdout = sys.stderr  # nothing else may write into the answers
    # what goes wrong here reaches the worker as an error in an answer, and is logged there, redacted;
    # this process has no log handlers of its own, so it logs nothing that could carry a credential
    logging.disable(logging.CRITICAL)
    try:
        url, identity = calls.next()
    except EOFError:
        return
    try:
        store = _open(url, identity)
    except Exception as exc:
        _send(out, ("raised", StorageError(str(exc))))
        return
    _send(out, ("ready", None))
    gc.freeze()  # what exists now (modules, the engine) lives as long as the process: out of every pass
    gc.set_threshold(50_000, 20, 10)  # as a worker's (see runtime.worker._tune_collector)
    until = 0.0  # the first write waits for nobody
    while True:
        try:
            pending = _gather(calls, until)
        except EOFError:
            break
        until = _company_until(pending, time.monotonic())
        try:
            for run in _runs(pending):  # each run answered once it is done: a claim waits for no later group
                _send(out, *_serve(store, run, _HELD))
        except BrokenPipeError:
            break
    store.close()


#: in the writer process, the records it answered the worker with (see _Held); unused in the worker's
_HELD = _Held(_CHILD_MOST)
