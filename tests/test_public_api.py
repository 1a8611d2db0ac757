"""The public surface is explicit, sorted and importable."""

from __future__ import annotations

import jobtrail


def test_all_is_sorted_and_complete() -> None:
    # constants first, then the rest (ruff's order: RUF022)
    assert jobtrail.__all__ == sorted(jobtrail.__all__, key=lambda name: (not name.isupper(), name))
    for name in jobtrail.__all__:
        assert getattr(jobtrail, name) is not None


def test_errors_round_trip_through_pickle() -> None:
    """Audited errors keep their arguments, so they can be stored and rebuilt."""
    import pickle

    err = jobtrail.OperationKeyConflict("changed request", operation_id="op_1", operation_key="k")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is jobtrail.OperationKeyConflict
    assert str(back) == "changed request" and back.details == {"operation_id": "op_1", "operation_key": "k"}
