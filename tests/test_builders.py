"""The ledger's records made without their constructor are the records their constructor makes."""

from __future__ import annotations

import dataclasses

import pytest

from jobtrail import Store
from jobtrail.domain.builders import builder
from jobtrail.domain.evidence import StatusObservation
from jobtrail.domain.record import Operation
from jobtrail.domain.states import RemoteState

from helpers import spec


def test_a_built_record_equals_the_constructed_one_and_stays_frozen(store: Store) -> None:
    op, _ = store.create_operation(spec())
    fields = {f.name: getattr(op, f.name) for f in dataclasses.fields(Operation)}
    build = builder(Operation, {name: f"d[{name!r}]" for name in fields}, "d")
    built = build(fields)
    assert type(built) is Operation
    assert built == op == Operation(**fields)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.state = op.state  # type: ignore[misc]


def test_a_subclass_record_sets_its_bases_fields_too() -> None:
    evidence = StatusObservation(remote_state=RemoteState.RUNNING, raw_state="running", http_status=200)
    names = [f.name for f in dataclasses.fields(StatusObservation)]
    build = builder(StatusObservation, {name: f"e.{name}" for name in names}, "e")
    assert build(evidence) == evidence


def test_a_builder_names_every_field_of_a_slotted_dataclass() -> None:
    names = [f.name for f in dataclasses.fields(Operation)]
    with pytest.raises(TypeError, match="every field"):
        builder(Operation, {name: "None" for name in names[1:]}, "")

    @dataclasses.dataclass
    class Plain:
        x: int

    with pytest.raises(TypeError, match="slots"):
        builder(Plain, {"x": "1"}, "")
