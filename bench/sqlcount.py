"""What reaches the database driver, counted in every process that writes: the bench's own and the
worker's writer process (started by the worker, it cannot be patched from here).

``count_in_children`` puts ``sqlcount_site`` on the PYTHONPATH the writer process inherits: its
``sitecustomize`` counts there with :func:`count_sql` and leaves the counts in a file when the
process exits (the worker closes it when it stops).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: where a counting child leaves its counts, and which database it writes to
FOLDER_VAR, DB_VAR = "JOBTRAIL_BENCH_SQL_COUNTS", "JOBTRAIL_BENCH_SQL_DB"


def count_sql(db: str) -> dict[str, int]:
    """Count what reaches the database driver: statements (each parameter set of an executemany; a
    COPY is one) and, on PostgreSQL, round trips (an execute, a pipelined executemany, a COPY, a
    transaction's BEGIN and its COMMIT or ROLLBACK)."""

    counts = {"statements": 0, "round_trips": 0, "commits": 0}
    if db.startswith("postgres"):
        import psycopg

        execute, executemany, copy = psycopg.Cursor.execute, psycopg.Cursor.executemany, psycopg.Cursor.copy
        commit, rollback = psycopg.Connection.commit, psycopg.Connection.rollback
        idle = psycopg.pq.TransactionStatus.IDLE

        def counted_execute(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
            counts["statements"] += 1
            counts["round_trips"] += 1
            return execute(self, query, params, **kw)

        def counted_executemany(self: Any, query: Any, params_seq: Any, **kw: Any) -> Any:
            params_seq = list(params_seq)
            counts["statements"] += len(params_seq)
            counts["round_trips"] += 1
            return executemany(self, query, params_seq, **kw)

        # a COPY (the ledger's bulk inserts) is one statement, its rows streamed in one round trip
        def counted_copy(self: Any, statement: Any, params: Any = None, **kw: Any) -> Any:
            counts["statements"] += 1
            counts["round_trips"] += 1
            return copy(self, statement, params, **kw)

        # a transaction costs two more: psycopg sends its BEGIN on its own, and the COMMIT or ROLLBACK
        def counted_commit(self: Any) -> Any:
            if self.info.transaction_status != idle:
                counts["round_trips"] += 2
                counts["commits"] += 1
            return commit(self)

        def counted_rollback(self: Any) -> Any:
            if self.info.transaction_status != idle:
                counts["round_trips"] += 2
            return rollback(self)

        psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign]
        psycopg.Cursor.executemany = counted_executemany  # type: ignore[method-assign]
        psycopg.Cursor.copy = counted_copy  # type: ignore[method-assign]
        psycopg.Connection.commit = counted_commit  # type: ignore[method-assign]
        psycopg.Connection.rollback = counted_rollback  # type: ignore[method-assign]
    else:
        # SQLite runs in-process: every statement it executes (BEGIN and COMMIT included), no round trips.
        # Counted by the driver's own connection and cursor classes, not a trace callback: sqlite3 hands a
        # trace callback each statement with its values written in, and building that text made a row of an
        # executemany cost three times as much (3.1 against 1.1 us for 700 bytes), put down to jobtrail
        import sqlite3

        class Cursor(sqlite3.Cursor):
            def execute(self, sql: str, parameters: Any = ()) -> Any:
                counts["statements"] += 1
                if sql.startswith("COMMIT"):
                    counts["commits"] += 1
                return super().execute(sql, parameters)

            def executemany(self, sql: str, seq_of_parameters: Any) -> Any:
                if not isinstance(seq_of_parameters, list | tuple):
                    seq_of_parameters = list(seq_of_parameters)
                counts["statements"] += len(seq_of_parameters)
                return super().executemany(sql, seq_of_parameters)

        class Connection(sqlite3.Connection):
            def cursor(self, factory: Any = Cursor) -> Any:  # Connection.execute makes its cursor here too
                return super().cursor(factory)

            def commit(self) -> None:
                if self.in_transaction:
                    counts["statements"] += 1
                    counts["commits"] += 1
                super().commit()

            def rollback(self) -> None:
                if self.in_transaction:
                    counts["statements"] += 1
                super().rollback()

        import sqlite3.dbapi2  # what SQLAlchemy's driver calls

        connect = sqlite3.dbapi2.connect

        def counted_connect(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("factory", Connection)
            return connect(*args, **kwargs)

        sqlite3.connect = sqlite3.dbapi2.connect = counted_connect  # type: ignore[assignment]
    return counts


def count_in_children(db: str) -> str:
    """From now on, the processes this one starts count what they send to ``db`` too."""
    folder = tempfile.mkdtemp(prefix="sqlcount-")
    os.environ[FOLDER_VAR], os.environ[DB_VAR] = folder, db
    paths = [str(HERE / "sqlcount_site"), str(HERE), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return folder


def children_counts(folder: str) -> dict[str, int]:
    """What the children that ended counted, summed."""
    total: dict[str, int] = {}
    for path in Path(folder).glob("*.json"):
        total = add_counts(total, json.loads(path.read_text()))
    return total


def add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in {*a, *b}}
