"""A worker's commits are made by a process of its own, and that changes nothing a caller relies on.

The writer process prepares and commits the worker's group commits (and claims)
so that their Python does not compete with the event loop for the interpreter
lock. A caller still resumes only once its write is durable; the credentials
the worker learns are masked there too; and the process lives and dies with its
worker: killed, it is replaced and nothing is lost or sent twice; its worker
killed, it exits; a Ctrl-C to the whole process group still stops the worker
gracefully.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest

from jobtrail import AsyncJobtrail, CreateAttempt, Operation, State, Store
from jobtrail.domain.errors import StaleRecord, StorageError
from jobtrail.domain.evidence import StatusObservation
from jobtrail.domain.redact import Redactor
from jobtrail.domain.states import RemoteState
from jobtrail.ledger import writer_process
from jobtrail.ledger.audit import verify
from jobtrail.ledger.store import Change, Create, Created, FollowUp, Moved, Observe, Release, Reschedule, StoredResult
from jobtrail.ledger.writer_process import WriterProcess, _Calls, _Delta, _gather, _message, _runs, _serve, _ToChild
from jobtrail.providers.http import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider

from helpers import spec
from processes import (
    finish,
    pipe_capacity,
    start_worker,
    stop_midway_through_a_write,
    submit_many,
    write_lock_held_elsewhere,
    write_provider,
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) has stopped running
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _wait_for(condition, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def _one_job_each(store: Store, fake: FakeProvider, ids: list[str]) -> None:
    for op_id in ids:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
    assert fake.counts["jobs_created"] == len(ids), fake.counts


async def _until(condition, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_workers_commits_are_made_by_a_process_of_its_own(db_url: str) -> None:
    fake = FakeProvider(job_duration_s=0.2).start()
    try:
        store = Store.open(db_url)
        worker = Worker(store, {"fake": load_provider(fake.provider_config())}, worker_id="w", idle_s=0.01)
        jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
        seen: set[int | None] = set()

        async def run() -> list[str]:
            running = asyncio.create_task(worker.run(timeout=120))
            await _until(lambda: worker.writer.process_id is not None)  # it starts in the background
            ids = [(await jt.submit("fake", {"i": i})).operation_id for i in range(60)]

            def settled() -> bool:
                seen.add(worker.writer.process_id)
                return all(store.get(i).state is State.SUCCEEDED for i in ids)

            await _until(settled)
            worker.stop()
            await running
            return ids

        ids = asyncio.run(run())
        assert len(seen) == 1 and os.getpid() not in seen, seen
        assert worker.stats.writes > 0 and worker.stats.transactions > 0
        assert not _alive(seen.pop()), "the writer process outlived its worker's run"  # type: ignore[arg-type]
        _one_job_each(store, fake, ids)
        assert verify(store).ok
        store.close()
    finally:
        fake.stop()


def test_a_credential_learned_after_the_writer_process_started_is_masked_there(db_url: str) -> None:
    store = Store.open(db_url, redactor=Redactor())
    op, _ = store.create_operation(spec())
    writer = WriterProcess.for_store(store)
    assert writer is not None
    secret = "sk-live-5f1e2d3c4b5a69788796a5b4c3d2e1f0"

    async def go() -> None:
        writer.start_soon()
        deadline = time.monotonic() + 30
        while not writer.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert writer.ready
        store.redactor.register(secret)  # as a provider does when it resolves its credential at send time
        await writer.post([(1, Observe(operation_id=op.operation_id, kind="status_poll", raw={"echo": secret}))])
        await writer.close()

    asyncio.run(go())
    stored = json.dumps(store.observations(op.operation_id))
    assert secret not in stored and "echo" in stored
    store.close()


def test_a_killed_writer_process_is_replaced_and_nothing_is_lost_or_sent_twice(db_url: str) -> None:
    fake = FakeProvider(job_duration_s=1.0).start()
    try:
        ids = submit_many(db_url, fake, 100)
        store = Store.open(db_url)
        worker = Worker(store, {"fake": load_provider(fake.provider_config())}, worker_id="w", idle_s=0.01, lease_s=15)

        async def run() -> tuple[int, int]:
            running = asyncio.create_task(worker.run(timeout=120))
            # killed in the middle: its process answers, and polls are being recorded
            await _until(lambda: worker.writer.process_id is not None and fake.counts["status"] >= 20)
            killed = worker.writer.process_id
            assert killed is not None
            os.kill(killed, signal.SIGKILL)
            # the worker goes on (writing in its own process meanwhile) and starts another one; the test stops it
            # only once both happened, so however slowly a loaded machine starts a process, it is seen
            await _until(lambda: worker.writer.process_id not in (None, killed))
            replaced = worker.writer.process_id
            assert replaced is not None
            await _until(lambda: all(store.get(i).state is State.SUCCEEDED for i in ids), timeout=90)
            worker.stop()
            await running
            return killed, replaced

        killed, replaced = asyncio.run(run())
        assert replaced != killed and not _alive(killed)
        _one_job_each(store, fake, ids)
        assert verify(store).ok
        store.close()
    finally:
        fake.stop()


def test_a_worker_asked_to_write_in_process_starts_no_writer_process(db_url: str, tmp_path: Path) -> None:
    """For hosts with several workers per core: less CPU per operation, and still every operation done."""
    fake = FakeProvider(job_duration_s=0.2).start()
    try:
        ids = submit_many(db_url, fake, 20)
        provider = write_provider(tmp_path / "fake.toml", fake)
        proc = start_worker(db_url, provider, "w", "--until-settled", "--timeout", "60", "--writes-in-process")
        seen: set[int] = set()
        while proc.poll() is None:
            seen.update(_children(proc.pid))
            time.sleep(0.01)
        code, out, err = finish(proc)
        assert code == 0, err
        assert not seen, "a writer process was started"
        assert json.loads(out)["writes"] > 0
        with Store.open(db_url) as store:
            _one_job_each(store, fake, ids)
    finally:
        fake.stop()


@pytest.mark.parametrize("how", ["SIGKILL to the worker", "Ctrl-C to the process group"])
def test_the_writer_process_ends_with_its_worker(db_url: str, tmp_path: Path, how: str) -> None:
    fake = FakeProvider(job_duration_s=5.0).start()
    try:
        ids = submit_many(db_url, fake, 30)
        provider = write_provider(tmp_path / "fake.toml", fake)
        proc = start_worker(db_url, provider, "w", "--lease", "30")
        assert _wait_for(lambda: fake.counts["jobs_created"] == 30)
        assert _wait_for(lambda: len(_children(proc.pid)) == 1)  # the writer process
        children = _children(proc.pid)
        if how == "SIGKILL to the worker":
            proc.send_signal(signal.SIGKILL)
            assert finish(proc, timeout=30)[0] == -signal.SIGKILL
        else:
            # a terminal's Ctrl-C reaches every process of the group: the writer must still take the
            # worker's last writes (its releases) and exit once the worker is done with it
            # (both processes signalled by pid: the test's own process group holds pytest too)
            for pid in (proc.pid, *children):
                os.kill(pid, signal.SIGINT)
            code, _out, err = finish(proc, timeout=30)
            assert code == 0, err
            with Store.open(db_url) as store:
                assert all(store.get(i).lease_owner is None for i in ids)
        assert _wait_for(lambda: not _alive(children[0]), timeout=15), "the writer process outlived its worker"
    finally:
        fake.stop()


def test_a_store_another_process_cannot_write_for_keeps_its_commits_in_process(tmp_path: Path) -> None:
    """In memory, nobody else can open it; on a clock of its own (a test's, the simulation's), the child's
    wall clock would write other times than the store's."""
    with Store.open(tmp_path / "wall.db") as store:
        assert WriterProcess.for_store(store) is not None
    with Store.open(tmp_path / "own-clock.db", clock=lambda: 1_000_000) as store:
        assert WriterProcess.for_store(store) is None
    with Store.open("sqlite:///:memory:") as store:
        assert WriterProcess.for_store(store) is None


def test_a_request_body_is_not_piped_with_every_write(db_url: str) -> None:
    """A body is fixed when its record is made and may be megabytes (a batch of prompts): the writes that
    follow send the record without it, and get back what changed, so the worker's record keeps its body."""
    store = Store.open(db_url)
    body = {"prompt": "x" * 1_000_000, "n": [1, 2.5, None]}
    op, _ = store.create_operation(spec(body=body, create_deadline=None))
    attempt = Change(op=op, evidence=CreateAttempt(attempt=1), actor="worker:w", changes={"attempts": 1})
    sent = _message(([], "apply_group", ([(1, attempt)],), {}), _ToChild)
    assert len(sent) < 10_000, f"{len(sent)} bytes for one write"
    writer = WriterProcess.for_store(store)
    assert writer is not None

    async def write() -> list[object]:
        writer.start_soon()
        await _until(lambda: writer.ready)
        outcomes, _ = await writer.post([(1, attempt)])
        await writer.close()
        return outcomes

    (new,) = asyncio.run(write())
    assert new == store.get(op.operation_id), "the record as stored, its body included"
    assert new.request_body == body and new.attempts == 1 and new.version == op.version + 1
    store.close()


def test_a_write_on_the_record_the_writer_process_answered_with_names_it_instead_of_sending_it(db_url: str) -> None:
    """Most writes are made on the record the last write or claim came back with: the child has that record
    already, so the write names it (its operation, version, time and epoch) and the child takes its own copy.
    What lands, and what the worker gets back, is what a write carrying the whole record makes."""
    store, (op,), writer = _records_and_writer(db_url, 1)

    async def run() -> tuple[list[object], int, int]:
        await _started(writer)
        (claimed,) = await writer.claim("w", limit=1, lease_s=30)
        attempt = Change(
            op=claimed,
            evidence=CreateAttempt(attempt=1),
            actor="worker:w",
            changes={"attempts": 1},
            epoch=claimed.lease_epoch,
        )
        named = len(
            _message(([], "apply_group", ([(1, attempt)],), {}), functools.partial(_ToChild, held=writer._held))
        )
        whole = len(_message(([], "apply_group", ([(1, attempt)],), {}), _ToChild))
        first, _ = await writer.post([(1, attempt)])
        (after,) = first
        assert isinstance(after, Operation)
        later = Reschedule(
            op=after, changes={"next_action_at_us": after.created_at_us + 5_000_000}, epoch=claimed.lease_epoch
        )
        assert writer._held.serial_of(after), "the record its write came back with"
        second, _ = await writer.post([(2, later)])
        await writer.close()
        return second, named, whole

    second, named, whole = asyncio.run(run())
    assert named < whole - 300, f"{named} bytes named against {whole} sent whole"
    (rescheduled,) = second
    stored = store.get(op.operation_id)
    assert rescheduled == stored, "the record as stored, its body included"
    assert stored.attempts == 1 and stored.next_action_at_us == op.created_at_us + 5_000_000
    assert verify(store).ok
    store.close()


def test_a_write_naming_a_record_the_writer_process_has_replaced_since_is_refused_as_stale(db_url: str) -> None:
    """The worker names a record it got back; if an answer it has not read yet replaced that record (a second
    write on the same record, sent before the first one's answer came), the second write was made on a record
    that moved on: it is refused as stale, as the database refuses a write on an old version, and lands nothing."""
    store, (op,), writer = _records_and_writer(db_url, 1)

    async def run() -> tuple[object, object]:
        await _started(writer)
        (claimed,) = await writer.claim("w", limit=1, lease_s=30)
        epoch = claimed.lease_epoch
        attempt = Change(
            op=claimed, evidence=CreateAttempt(attempt=1), actor="worker:w", changes={"attempts": 1}, epoch=epoch
        )
        first = writer.post([(1, attempt)])
        # the loop held (its reader cannot read the answer) until the child has committed the first write
        assert _wait_for(lambda: store.get(op.operation_id).attempts == 1)
        assert writer._held.serial_of(claimed), "this end has not read the answer yet: it names the claimed record"
        again = Reschedule(op=claimed, changes={"next_action_at_us": claimed.created_at_us + 9_000_000}, epoch=epoch)
        second = writer.post([(2, again)])
        ((landed,), _), ((refused,), _) = await first, await second
        await writer.close()
        return landed, refused

    landed, refused = asyncio.run(run())
    assert isinstance(landed, Operation) and landed.attempts == 1
    assert isinstance(refused, Moved) and isinstance(refused.error, StaleRecord)
    assert store.get(op.operation_id) == landed, "the stale write changed nothing"
    assert verify(store).ok
    store.close()


def test_two_records_of_one_operation_answered_together_are_told_apart(db_url: str) -> None:
    """Found in review: two reschedules of one record, landing in one transaction, come back as two records
    with the same version, time and epoch. A write made on the first must not be taken for one made on the
    second: each record the child holds has a serial of its own, and the worker names only the very record
    it got back last, so the worker's record and the ledger's stay the same."""
    store, (op,), writer = _records_and_writer(db_url, 1)

    async def run() -> tuple[Operation, Operation, Operation]:
        await _started(writer)
        (claimed,) = await writer.claim("w", limit=1, lease_s=30)
        later = claimed.created_at_us + 1_000_000
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGSTOP)  # both on the pipe before the child reads either: one transaction
        first = writer.post([(1, Reschedule(op=claimed, changes={"next_action_at_us": later}))])
        second = writer.post([(2, Reschedule(op=claimed, changes={"polls": 7}))])
        await asyncio.sleep(0.05)
        os.kill(writer.pid, signal.SIGCONT)
        ((one,), _), ((two,), _) = await first, await second
        assert isinstance(one, Operation) and isinstance(two, Operation)
        assert not writer._held.serial_of(one) and writer._held.serial_of(two), "the last one answered is held"
        ((three,), _) = await writer.post([(3, Reschedule(op=one, changes={"attempts": 5}))])
        await writer.close()
        assert isinstance(three, Operation)
        return one, two, three

    _, _, three = asyncio.run(run())
    assert three == store.get(op.operation_id), "what the worker holds is what the ledger holds"
    store.close()


def test_an_answer_that_cannot_be_followed_fails_its_own_caller(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the worker's reader makes a group's outcomes of the child's answer; if that failed
    (a bug), the call it had taken off the queue was never answered, and its writers waited forever. Now
    that call hears the error, and the calls after it are answered as usual."""
    store, (op,), writer = _records_and_writer(db_url, 1)
    real = writer_process._Waiting.followed
    calls = []

    def followed(self, answer, held):  # type: ignore[no-untyped-def]
        calls.append(self.method)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(self, answer, held)

    monkeypatch.setattr(writer_process._Waiting, "followed", followed)

    async def run() -> tuple[object, object]:
        await _started(writer)
        observe = Observe(operation_id=op.operation_id, kind="status_poll", raw={})
        first = writer.post([(1, observe)])
        second = writer.post([(2, observe)])
        with pytest.raises(StorageError, match="could not be read"):
            await asyncio.wait_for(first, 10)
        answered = await asyncio.wait_for(second, 10)
        await writer.close()
        return answered

    (ids, _) = asyncio.run(run())
    assert len(ids) == 1 and isinstance(ids[0], int)
    store.close()


def test_each_end_forgets_its_oldest_records_past_its_bound_without_refusing_a_write(db_url: str) -> None:
    """Found in review: the records held are bounded, and forgetting them at once made writes already on
    the pipe, or the next ones, refused as stale though nothing had moved. Each end forgets its oldest
    first, the child only past four times the worker's bound, so the worker never names a record the
    child forgot. (Here the worker's bound is two, the child's its own.)"""
    store, ops, writer = _records_and_writer(db_url, 5)

    async def run() -> list[object]:
        await _started(writer)
        writer._held._most = 2  # the worker's bound; the running child keeps its own (4 x 50,000)
        claimed = await writer.claim("w", limit=5, lease_s=30)
        assert len(writer._held.records) == 2, "the worker keeps its two newest"
        posts = [writer.post([(n, Reschedule(op=op, changes={"polls": 3}))]) for n, op in enumerate(claimed)]
        outcomes = [outcome for post in posts for outcome in (await post)[0]]
        await writer.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert all(isinstance(o, Operation) and o.polls == 3 for o in outcomes), outcomes
    assert all(store.get(op.operation_id).polls == 3 for op in ops)
    store.close()


def test_a_value_that_changed_only_its_type_comes_back_changed(store: Store) -> None:
    """Found in review: the child's answer named the fields that were not equal, and ``1 == True``: partial
    effects that went from 1 to true came back as 1, and the worker's next write would have stored 1 again."""
    op, _ = store.create_operation(spec())
    before = dataclasses.replace(op, partial_effects={"done": 1}, polls=1)
    for after in (
        dataclasses.replace(before, partial_effects={"done": True}),
        dataclasses.replace(before, partial_effects={"done": 1.0}),
        dataclasses.replace(before, polls=True),
    ):
        back = _Delta.between(before, after).applied_to(before)
        assert back == after
        assert repr((back.partial_effects, back.polls)) == repr((after.partial_effects, after.polls))


def test_what_crosses_the_pipe_arrives_equal(store: Store) -> None:
    """Records travel as their fields (not pickle's own way for dataclasses): every kind the worker sends
    or gets back comes out equal, enums as the same members."""
    op, _ = store.create_operation(spec())
    result = StoredResult(
        sha256="ab" * 32, size=3, content_type="text/plain", body=b"abc", path=None, checks=[{"size": 3}], summary=None
    )
    evidence = StatusObservation(remote_state=RemoteState.SUCCEEDED, raw_state="done", http_status=200, progress=1.0)
    messages = [
        Change(
            op=op,
            evidence=evidence,
            actor="worker:w",
            to=State.OBSERVING,
            changes={"polls": 1},
            epoch=4,
            request_ids=("req_1",),
            result=result,
            then=FollowUp(to=State.SUCCEEDED, evidence=evidence),
        ),
        Observe(operation_id=op.operation_id, kind="status_poll", raw={"nested": [1, 2.5, None, "x"]}),
        Reschedule(op=op, changes={"next_action_at_us": 5}),
        Release(operation_id=op.operation_id, epoch=4),
        Create(spec=spec(), actor="agent"),
        Created(op=op, new=False),
        Moved(StaleRecord("moved on", operation_id=op.operation_id, epoch=3)),
        op,
    ]
    for message in messages:
        back = pickle.loads(_message(message)[8:])
        if isinstance(message, Moved):
            assert type(back.error) is StaleRecord and str(back.error) == "moved on"
            assert back.error.details == message.error.details
        else:
            assert back == message
    assert pickle.loads(_message(State.SUCCEEDED)[8:]) is State.SUCCEEDED


def test_groups_sent_while_one_is_committed_are_committed_together(store: Store) -> None:
    """The worker sends a group without waiting for the last one's commit; the child takes every group
    that has arrived (whole) into one transaction and answers each group on its own, in order. A claim
    ends what is taken (the worker waits on it), and sees the groups before it, not those after."""
    ops = [store.create_operation(spec())[0] for _ in range(3)]
    first, second, third = (
        _message(([], "apply_group", ([_attempt(n, op)],), {}), _ToChild) for n, op in enumerate(ops)
    )
    claim = ([], "claim", ("w",), {"limit": 10, "lease_s": 30})
    long_ago = time.monotonic() - 60  # the last transaction: nothing waits for more to come
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, first + second + _message(claim) + third[:20])  # the third group half sent
        calls = _Calls(read_end)
        runs = _runs(_gather(calls, long_ago))
        assert [[method for _, method, _, _ in run] for run in runs] == [["apply_group", "apply_group"], ["claim"]]
        (one, two) = _serve(store, runs[0])
        assert one[0] == two[0] == "done"
        assert (one[1][1], two[1][1]) == (1, 0), "one transaction for both groups"
        assert [store.get(op.operation_id).attempts for op in ops] == [1, 1, 0]
        ((kind, (claimed, _)),) = _serve(store, runs[1])
        assert kind == "done"
        seen = {op.operation_id: op.attempts for op in claimed}
        assert seen == {ops[0].operation_id: 1, ops[1].operation_id: 1, ops[2].operation_id: 0}
        assert not calls.fill(0) and calls.take() is writer_process._NOTHING, "half a message is not a message"
        os.write(write_end, third[20:])
        (rest,) = _gather(calls, long_ago)
        os.close(write_end)
        write_end = -1
        ((_, (_, transactions)),) = _serve(store, [rest])
        assert transactions == 1 and store.get(ops[2].operation_id).attempts == 1
        with pytest.raises(EOFError):
            calls.next()
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert verify(store).ok


def test_a_transaction_of_the_writer_process_takes_at_most_its_share_of_writes(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many groups wait in the pipe (a backlog), one transaction takes up to GROUP_MAX writes;
    the rest, read already, go in the next."""
    monkeypatch.setattr(writer_process, "GROUP_MAX", 2)
    ops = [store.create_operation(spec())[0] for _ in range(3)]
    read_end, write_end = os.pipe()
    try:
        for n, op in enumerate(ops):
            os.write(write_end, _message(([], "apply_group", ([_attempt(n, op)],), {}), _ToChild))
        calls = _Calls(read_end)
        long_ago = time.monotonic() - 60
        assert len(_gather(calls, long_ago)) == 2
        assert len(_gather(calls, long_ago)) == 1
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_lone_write_is_committed_at_once_and_writes_under_load_wait_for_company(store: Store) -> None:
    """One operation's steps come one after another: each is committed as it comes, never held back for
    writes that are not coming. A transaction of many writes is load: the next one waits (up to the pace)
    for the writes that arrive meanwhile, and takes them together."""
    ops = [store.create_operation(spec())[0] for _ in range(writer_process._COMPANY + 1)]
    lone = [([], "apply_group", ([_attempt(0, ops[0])],), {})]
    crowd = [([], "apply_group", ([_attempt(n, op) for n, op in enumerate(ops)],), {})]
    assert writer_process._company_until(lone, 100.0) == 0.0
    assert writer_process._company_until([([], "claim", ("w",), {})], 100.0) == 0.0
    assert writer_process._company_until(crowd, 100.0) == 100.0 + writer_process._COMMIT_EVERY_S

    first, second = (_message(([], "apply_group", ([_attempt(n, op)],), {}), _ToChild) for n, op in enumerate(ops[:2]))
    read_end, write_end = os.pipe()
    try:
        calls = _Calls(read_end)
        for waits, late_by, taken in ((0.0, 0.5, 1), (1.0, 0.1, 2)):
            os.write(write_end, first)
            later = threading.Timer(late_by, os.write, (write_end, second))
            later.start()
            until = time.monotonic() + waits if waits else 0.0  # 0.0: as after a lone write
            assert len(_gather(calls, until)) == taken
            later.join()
            while calls.fill(0.05) or calls.take() is not writer_process._NOTHING:
                pass  # what the lone case left in the pipe: not part of the next case
    finally:
        os.close(read_end)
        os.close(write_end)


def _records_and_writer(url: str, n: int) -> tuple[Store, list[Operation], WriterProcess]:
    """A ledger with ``n`` new records, and a writer process for it (not started)."""
    store = Store.open(url)
    ops = [store.create_operation(spec())[0] for _ in range(n)]
    writer = WriterProcess.for_store(store)
    assert writer is not None
    return store, ops, writer


async def _started(writer: WriterProcess) -> None:
    """Start the writer process and wait until it takes calls."""
    writer.start_soon()
    await _until(lambda: writer.ready)


def _attempt(request: int, op: Operation) -> tuple[int, Change]:
    return request, Change(op=op, evidence=CreateAttempt(attempt=1), actor="worker:w", changes={"attempts": 1})


def test_a_busy_writer_process_commits_what_arrived_meanwhile_in_one_transaction(db_url: str) -> None:
    """Ten groups sent at once (as a worker with few connections trickles them in, one per window): the
    first is committed at once, the others, arrived meanwhile, together; not a transaction each."""
    store, ops, writer = _records_and_writer(db_url, 10)

    async def go() -> list[tuple[list[object], int]]:
        await _started(writer)
        sent = [
            writer.post([(n, Observe(operation_id=op.operation_id, kind="status_poll", raw={"n": n}))])
            for n, op in enumerate(ops)
        ]
        answers = await asyncio.gather(*sent)
        await writer.close()
        return answers

    answers = asyncio.run(go())
    assert all(isinstance(outcomes[0], int) for outcomes, _ in answers), "each group has its observation's id"
    assert sum(transactions for _, transactions in answers) <= 2
    assert all(len(store.observations(op.operation_id)) == 1 for op in ops)
    store.close()


def test_groups_sent_while_the_ledger_is_locked_elsewhere_land_together_once_it_is_free(tmp_path: Path) -> None:
    """Another process holds SQLite's write lock: the first group waits for it in the child, the groups sent
    meanwhile wait in the pipe, and once the lock is free they land in one transaction; every caller hears
    its own outcome and nothing is lost."""
    path = tmp_path / "locked.db"
    store, ops, writer = _records_and_writer(str(path), 5)

    async def go() -> list[tuple[list[object], int]]:
        await _started(writer)
        with write_lock_held_elsewhere(str(path), 1.5):
            sent = []
            for n, op in enumerate(ops):
                sent.append(writer.post([_attempt(n, op)]))
                await asyncio.sleep(0.05)  # one at a time, while the lock is held: the first one waits for it
            answers = await asyncio.gather(*sent)
        await writer.close()
        return answers

    answers = asyncio.run(go())
    firsts = [outcomes[0] for outcomes, _ in answers]
    assert all(isinstance(new, Operation) and new.attempts == 1 for new in firsts), firsts
    # the first group, then the four sent meanwhile (a child slow to read the first takes more of them with it)
    assert sum(transactions for _, transactions in answers) <= 2
    assert [store.get(op.operation_id).attempts for op in ops] == [1] * 5
    assert verify(store).ok
    store.close()


def test_bytes_on_the_pipe_that_are_no_answer_fail_the_calls_waiting_and_a_new_child_takes_the_writes(
    tmp_path: Path,
) -> None:
    """Bytes on the answer pipe that are no answer (a profiler's stop cut an answer short once, and the
    worker waited for ever): nothing after them can be matched to a call, so every call waiting hears an error
    that names it, the child is stopped, and the next child commits the write sent again."""
    path = tmp_path / "garbled.db"
    store, (op,), writer = _records_and_writer(str(path), 1)

    async def go() -> tuple[int, int, object]:
        await _started(writer)
        first = writer.pid
        assert first is not None
        # the child waits for the lock, so its real answer cannot come before the garbage
        with write_lock_held_elsewhere(str(path), 1.0):
            waiting = writer.post([_attempt(0, op)])
            assert writer._proc is not None and writer._proc.stdout is not None
            writer._proc.stdout.feed_data(writer_process._LENGTH.pack(5) + b"\x00junk")
            with pytest.raises(StorageError, match=r"sent bytes that are no answer .* not confirmed"):
                await asyncio.wait_for(waiting, 20)
        assert not writer.ready and not _alive(first)
        await _started(writer)
        second = writer.pid
        assert second is not None
        (outcome,), _ = await writer.post([_attempt(1, op)])
        await writer.close()
        return first, second, outcome

    first, second, outcome = asyncio.run(go())
    assert second != first
    assert isinstance(outcome, Operation) and outcome.attempts == 1
    assert store.get(op.operation_id).attempts == 1, "the stopped child's write did not land as well"
    assert verify(store).ok
    store.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/wchan"), reason="needs Linux's /proc/<pid>/wchan")
def test_an_answer_interrupted_by_a_stop_arrives_whole_where_python_writes_unbuffered(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PYTHONUNBUFFERED=1 (set by many container images) makes the child's standard output the raw file, whose
    write took only part of an answer larger than the pipe when a signal interrupted it (a profiler's stop
    did, and the worker lost its writer process): the child stopped and continued in the middle of a claim's
    answer, the worker still gets the whole answer, and the next write lands."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # what the child inherits
    store = Store.open(db_url)
    n = max(200, 4 * pipe_capacity() // 2000)  # an answer four times what the pipe holds, at least
    specs = [spec(body={"prompt": f"{i} " + "x" * 2000}, create_deadline=None) for i in range(n)]
    ops = {op.operation_id: op for op, _ in store.create_operations(specs)}
    writer = WriterProcess.for_store(store)
    assert writer is not None

    async def go() -> tuple[list[Operation], object]:
        await _started(writer)
        pid = writer.pid
        assert pid is not None
        try:
            claim = asyncio.ensure_future(writer.claim("w", limit=n, lease_s=60))
            await asyncio.sleep(0)  # on the pipe; this loop reads no answer until the stops are over
            stop_midway_through_a_write(pid)
            claimed = await asyncio.wait_for(claim, 30)
            (outcome,), _ = await writer.post([_attempt(1, claimed[0])])
        finally:
            await writer.close()
        return claimed, outcome

    try:
        claimed, outcome = asyncio.run(go())
        assert sorted(op.operation_id for op in claimed) == sorted(ops), "every record, once"
        assert all(op.request_body == ops[op.operation_id].request_body for op in claimed), "each body whole"
        assert isinstance(outcome, Operation) and outcome == store.get(outcome.operation_id)
        assert verify(store).ok
    finally:
        store.close()
