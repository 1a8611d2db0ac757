"""Schema upgrades keep a user's data."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from jobtrail import Store
from jobtrail._audit import verify
from jobtrail._migrate import current_revision, head_revision

from helpers import S, op_in


def test_upgrade_from_the_first_schema_keeps_every_record(open_store: Callable[..., Store]) -> None:
    """A database made by revision 0001 upgrades to head with records and chains intact."""
    old = open_store(migrate=False)
    old.migrate("0001")
    with old.engine.connect() as conn:
        assert current_revision(conn) == "0001"
        assert not sa.inspect(conn).has_table("observations")
    made = [
        op_in(old, state, body={"i": i}) for i, state in enumerate((S.CREATE_PENDING, S.OBSERVING, S.FAILED))
    ]
    old.close()

    new = open_store()  # opening upgrades
    with new.engine.connect() as conn:
        assert current_revision(conn) == head_revision()
    for op in made:
        assert new.get(op.operation_id) == op
        assert len(new.history(op.operation_id)) == op.version
    assert verify(new).ok
    assert new.add_observation(made[1].operation_id, kind="status_poll", raw={"status": "running"}) > 0


def test_opening_twice_is_harmless(open_store: Callable[..., Store]) -> None:
    a = open_store()
    op = op_in(a, S.ACCEPTED)
    b = open_store()
    assert b.get(op.operation_id) == op
