"""Loaded at start by every process the bench starts with this folder on PYTHONPATH (see sqlcount.py):
a worker's writer process counts what it sends to the database and leaves the counts at exit."""

import atexit
import json
import os

if os.environ.get("JOBTRAIL_BENCH_SQL_COUNTS"):
    from sqlcount import DB_VAR, FOLDER_VAR, count_sql

    _counts = count_sql(os.environ[DB_VAR])

    def _leave() -> None:
        with open(os.path.join(os.environ[FOLDER_VAR], f"{os.getpid()}.json"), "w") as out:
            json.dump(_counts, out)

    atexit.register(_leave)
