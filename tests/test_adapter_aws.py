"""The AWS adapters (aws-stepfunctions, aws-athena) against moto in server mode on 127.0.0.1.

moto runs its real HTTP server (``ThreadedMotoServer``) in this process; Step Functions executions
run through moto's ASL interpreter (``/moto-api/config`` with ``execute_state_machine``), so Wait
and Pass states take real time and produce real output. Faults are injected by a loopback TCP proxy
in front of moto that can forward a request and drop its answer, or answer in moto's place. Counts
come from moto itself (ListExecutions via boto3) and from what the proxy saw.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from jobtrail import AsyncJobtrail, Store
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.states import State
from jobtrail.ledger.results import read_result
from jobtrail.providers.kinds import load_provider
from jobtrail.runtime.worker import Worker

from helpers import canary_hits, ledger_bytes
from processes import cli, finish, start_worker

# an adapter speaks HTTP; the ledger behind it is proven on both engines by the ledger's own tests:
# each test's SQLite run is in the fast tier, its PostgreSQL run in the long tier
pytestmark = pytest.mark.long_on_postgres

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/jobtrail-test"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# -- moto, credentials, the proxy ------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """moto's server on a free loopback port, with Step Functions executing state machines."""
    from moto.core.config import default_user_config

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    before = dict(default_user_config.get("stepfunctions", {}))
    request = urllib.request.Request(
        url + "/moto-api/config",
        data=json.dumps({"stepfunctions": {"execute_state_machine": True}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 201
    yield url
    default_user_config["stepfunctions"] = before  # type: ignore[typeddict-item]
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """Fake credentials for botocore's default chain (a fresh canary secret and session token per test)."""
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAJOBTRAILTEST" + secrets.token_hex(2).upper(),
        "AWS_SECRET_ACCESS_KEY": "jtcanary_" + secrets.token_hex(12),
        "AWS_SESSION_TOKEN": "jtcanarytok_" + secrets.token_hex(12),
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "JOBTRAIL_DATA_DIR": str(tmp_path / "results"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return env


@dataclass
class Seen:
    target: str
    headers: dict[str, str]
    body: bytes
    raw_head: bytes
    path: str
    method: str


@dataclass
class Proxy:
    """A loopback TCP proxy in front of moto: one request per connection (moto answers Connection: close).

    ``plan(seen)`` says what to do with each request: "forward", "drop" (forward it, let moto act,
    then close the client's connection without an answer) or the raw bytes of an answer of our own.
    """

    upstream: tuple[str, int]
    plan: Callable[[Seen], str | bytes] = lambda seen: "forward"
    seen: list[Seen] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def start(self) -> Proxy:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._sock.close()

    def targets(self, action: str) -> list[Seen]:
        return [s for s in self.seen if s.target.endswith("." + action)]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                body += conn.recv(65536)
            seen = Seen(headers.get("x-amz-target", ""), headers, body, head, path, method)
            self.seen.append(seen)
            action = self.plan(seen)
            if isinstance(action, bytes):
                conn.sendall(action)
                return
            with socket.create_connection(self.upstream) as up:
                up.sendall(head + b"\r\n\r\n" + body)
                answer = b""
                while chunk := up.recv(65536):
                    answer += chunk
            if action == "drop":
                self.dropped.append(seen.target)
                return  # moto acted on it; the client never hears
            conn.sendall(answer)


@pytest.fixture
def proxy(moto_url: str) -> Iterator[Proxy]:
    host, port = moto_url.removeprefix("http://").split(":")
    p = Proxy((host, int(port))).start()
    yield p
    p.stop()


def aws_answer(status: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/x-amz-json-1.0\r\nContent-Length: {len(data)}\r\n"
        f"x-amzn-RequestId: req-{uuid.uuid4()}\r\nConnection: close\r\n\r\n"
    ).encode() + data


# -- Step Functions in moto -----------------------------------------------------------------------


def sfn(moto_url: str) -> Any:
    return boto3.client("stepfunctions", endpoint_url=moto_url, region_name=REGION)


def state_machine(moto_url: str, wait_s: int = 0) -> str:
    """A STANDARD state machine that waits ``wait_s`` seconds, then echoes its input."""
    done = {"Type": "Pass", "Parameters": {"echo.$": "$", "ok": True}, "End": True}
    states: dict[str, Any] = {"Done": done}
    start = "Done"
    if wait_s:
        states["Wait"] = {"Type": "Wait", "Seconds": wait_s, "Next": "Done"}
        start = "Wait"
    definition = {"StartAt": start, "States": states}
    made = sfn(moto_url).create_state_machine(
        name=f"sm-{uuid.uuid4().hex[:12]}", definition=json.dumps(definition), roleArn=ROLE
    )
    return str(made["stateMachineArn"])


def executions(moto_url: str, arn: str) -> list[dict[str, Any]]:
    return list(sfn(moto_url).list_executions(stateMachineArn=arn)["executions"])


FAST = """
timeout_s = 3
connect_timeout_s = 1
[poll]
initial_s = 0.2
factor = 1.5
cap_s = 0.5
jitter = 0
[retry]
initial_s = 0.1
factor = 1.5
cap_s = 0.3
jitter = 0
"""


def sfn_file(path: Path, base_url: str, arn: str, extra: str = "") -> Path:
    path.write_text(
        f'kind = "aws-stepfunctions"\nname = "sfn"\nstate_machine_arn = "{arn}"\nbase_url = "{base_url}"\n'
        + extra
        + FAST,
        encoding="utf-8",
    )
    return path


def athena_file(path: Path, base_url: str) -> Path:
    path.write_text(
        f'kind = "aws-athena"\nname = "athena"\nregion = "{REGION}"\nbase_url = "{base_url}"\n'
        'work_group = "primary"\noutput_location = "s3://jobtrail-results/q/"\n' + FAST,
        encoding="utf-8",
    )
    return path


def run_in_process(
    db_url: str, provider_file: Path, bodies: list[Any], *, seconds: float = 30, **submit: Any
) -> tuple[Store, list[str]]:
    store = Store.open(db_url)
    provider = load_provider(provider_file)

    async def go() -> list[str]:
        jt = AsyncJobtrail(store=store, providers=[provider])
        ids = [(await jt.submit(provider.name, body, **submit)).operation_id for body in bodies]
        await Worker(store, {provider.name: provider}, worker_id="w1", idle_s=0.02, lease_s=10).run(
            until_settled=True, timeout=seconds
        )
        await provider.aclose()
        return ids

    return store, asyncio.run(go())


def causes(store: Store, op_id: str) -> list[str]:
    return [entry.cause for entry in store.history(op_id)]


# -- Step Functions ---------------------------------------------------------------------------------


def test_sfn_worker_killed_mid_flight_restarts_and_ends_as_moto_says(
    db_url: str, moto_url: str, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """submit; a real worker starts the execution and is killed -9 while it runs; the next worker
    finishes: SUCCEEDED, moto's output stored byte for byte, exactly one execution, no secret stored."""
    arn = state_machine(moto_url, wait_s=3)
    provider = sfn_file(tmp_path / "sfn.toml", moto_url, arn)
    with Store.open(db_url) as store:

        async def submit() -> str:
            jt = AsyncJobtrail(store=store, providers=[provider])
            return (await jt.submit("sfn", {"order": 42, "items": ["a", "b"]})).operation_id

        op_id = asyncio.run(submit())
        doomed = start_worker(db_url, provider, "doomed", "--lease", "5", env=aws_env)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            op = store.get(op_id)
            if op.state is State.OBSERVING and op.remote_state == "RUNNING":
                break
            time.sleep(0.05)
        assert store.get(op_id).state is State.OBSERVING, store.get(op_id).state_reason
        assert [e["status"] for e in executions(moto_url, arn)] == ["RUNNING"]  # mid-flight
        doomed.send_signal(signal.SIGKILL)
        _, doomed_err = doomed.communicate(timeout=30)
        assert doomed.returncode == -signal.SIGKILL
        survivor = start_worker(
            db_url, provider, "survivor", "--until-settled", "--timeout", "60", "--lease", "5", env=aws_env
        )
        code, out, err = finish(survivor, timeout=90)
        assert code == 0, err
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        listed = executions(moto_url, arn)
        assert len(listed) == 1 and listed[0]["status"] == "SUCCEEDED"
        assert (
            op.remote_job_id
            == listed[0]["executionArn"]
            == arn.replace(":stateMachine:", ":execution:") + (":" + op.idempotency_token)
        )
        output = sfn(moto_url).describe_execution(executionArn=op.remote_job_id)["output"]
        _, data = read_result(store, op_id)
        assert data == output.encode()
        assert json.loads(data) == {"echo": {"items": ["a", "b"], "order": 42}, "ok": True}
        assert causes(store, op_id).count("create_attempt") == 1  # the create was never repeated
        held = ledger_bytes(store)
        for secret in (aws_env["AWS_SECRET_ACCESS_KEY"], aws_env["AWS_SESSION_TOKEN"]):
            assert canary_hits(secret, held) == []
            assert canary_hits(secret, out + err + doomed_err) == []


def test_sfn_lost_create_response_is_replayed_by_name_one_execution(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """moto starts the execution but its answer is lost; the replay with the same name and input
    answers with the same execution (it is still running): confirmed via replay, one execution."""
    arn = state_machine(moto_url, wait_s=1)
    dropped = {"n": 0}

    def plan(seen: Seen) -> str:
        if seen.target.endswith(".StartExecution") and dropped["n"] == 0:
            dropped["n"] += 1
            return "drop"
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 1}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert len(executions(moto_url, arn)) == 1
        starts = proxy.targets("StartExecution")
        assert len(starts) == 2 and proxy.dropped == ["AWSStepFunctions.StartExecution"]
        assert starts[0].body == starts[1].body  # the same name and input, byte for byte
        assert json.loads(starts[0].body)["name"] == op.idempotency_token
        history = causes(store, op_id)
        assert "ambiguous_create" in history and "definitive_rejection" not in history
        confirmed = [json.loads(e.evidence) for e in store.history(op_id) if e.cause == "confirmed_create"]
        assert confirmed and confirmed[0]["via"] == "replay"


def test_sfn_each_operation_runs_on_the_state_machine_its_record_names(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """The target a submit names is the machine its execution starts on, on every attempt: the replay after
    a lost answer goes there too, whichever state machine the provider file names (an execution name is
    unique per machine only). Before, the target was recorded and ignored, and a replay after the file
    changed started a second execution on the other machine. A target that is no state machine of the
    provider's region is refused at submit."""
    named, other = state_machine(moto_url, wait_s=1), state_machine(moto_url)
    proxy.plan = lambda seen: "drop" if seen.target.endswith(".StartExecution") and not proxy.dropped else "forward"
    provider_file = sfn_file(tmp_path / "sfn.toml", proxy.url, other)
    store, (op_id,) = run_in_process(db_url, provider_file, [{"n": 1}], target=named)
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED and op.target == named, op.state_reason
        assert op.remote_job_id == f"{named.replace(':stateMachine:', ':execution:')}:{op.idempotency_token}"
        assert len(executions(moto_url, named)) == 1 and executions(moto_url, other) == []
        starts = proxy.targets("StartExecution")
        assert len(starts) == 2 and {json.loads(s.body)["stateMachineArn"] for s in starts} == {named}
        jt = AsyncJobtrail(store=store, providers=[load_provider(provider_file)])
        for target in ("arn:aws:states:eu-west-1:123456789012:stateMachine:x", "sm-by-name"):
            with pytest.raises(ConfigError, match="is not a state machine of this provider's region"):
                asyncio.run(jt.submit("sfn", {"n": 2}, target=target))
        assert store.count() == 1


def test_sfn_replay_after_the_execution_closed_is_adopted_not_rejected(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """The lost create's execution finishes before the replay: ExecutionAlreadyExists is settled by
    DescribeExecution of the name's ARN (same input): adopted, never recorded as a rejection."""
    arn = state_machine(moto_url, wait_s=0)
    finished = threading.Event()

    def plan(seen: Seen) -> str:
        if seen.target.endswith(".StartExecution") and not finished.is_set():
            finished.set()
            return "drop"
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 2}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert len(executions(moto_url, arn)) == 1
        assert len(proxy.targets("StartExecution")) == 2
        describes = proxy.targets("DescribeExecution")
        assert json.loads(describes[0].body) == {"executionArn": op.remote_job_id}
        replay = [o for o in store.observations(op_id) if o["kind"] == "create_response"][-1]["raw"]
        assert replay["outcome"] == "confirmed"
        assert "ExecutionAlreadyExists" in json.dumps(replay["body"]["StartExecution"])
        assert "definitive_rejection" not in causes(store, op_id)
        assert json.loads(read_result(store, op_id)[1]) == {"echo": {"n": 2}, "ok": True}


def test_sfn_name_taken_by_another_input_is_never_adopted(
    db_url: str, moto_url: str, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """An execution with our token's name but another input is not ours: not adopted, not a second
    execution, not a rejection; the operation stops for a person (needs_attention)."""
    arn = state_machine(moto_url, wait_s=0)
    provider = sfn_file(tmp_path / "sfn.toml", moto_url, arn)
    store = Store.open(db_url)

    async def go() -> str:
        jt = AsyncJobtrail(store=store, providers=[provider])
        op = await jt.submit("sfn", {"mine": True})  # stops at once: no waiting out the create deadline
        sfn(moto_url).start_execution(stateMachineArn=arn, name=op.idempotency_token, input='{"theirs": true}')
        adapter = jt.provider("sfn")
        await Worker(store, {"sfn": adapter}, worker_id="w1", idle_s=0.02, lease_s=10).run(
            until_settled=True, timeout=20
        )
        await adapter.aclose()
        return op.operation_id

    op_id = asyncio.run(go())
    with store:
        op = store.get(op_id)
        assert op.state is State.NEEDS_ATTENTION, op.state_reason
        assert "is taken by" in (op.state_reason or "") and op.remote_job_id is None
        assert "definitive_rejection" not in causes(store, op_id)
        listed = executions(moto_url, arn)
        assert len(listed) == 1
        answers = [o["raw"] for o in store.observations(op_id) if o["kind"] == "create_response"]
        assert [a["error_class"] for a in answers] == ["execution_name_taken"]  # one create, no replays


def test_sfn_wire_calls_are_signed_over_the_exact_bytes_with_their_own_target(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """Every call is POST / with its own X-Amz-Target, Content-Type 1.0 and body; each SigV4 signature
    verifies over the headers and body bytes as the server received them; the token travels signed."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    arn = state_machine(moto_url, wait_s=0)
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 3}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
    targets = [s.target for s in proxy.seen]
    assert targets[0] == "AWSStepFunctions.StartExecution"
    assert set(targets) == {"AWSStepFunctions.StartExecution", "AWSStepFunctions.DescribeExecution"}
    creds = Credentials(aws_env["AWS_ACCESS_KEY_ID"], aws_env["AWS_SECRET_ACCESS_KEY"], aws_env["AWS_SESSION_TOKEN"])
    for seen in proxy.seen:
        assert (seen.method, seen.path) == ("POST", "/")
        assert seen.headers["content-type"] == "application/x-amz-json-1.0"
        assert seen.headers["x-amz-security-token"] == aws_env["AWS_SESSION_TOKEN"]
        body = json.loads(seen.body)
        if seen.target.endswith("StartExecution"):
            assert body == {"stateMachineArn": arn, "name": op.idempotency_token, "input": '{"n":3}'}
        else:
            assert body == {"executionArn": op.remote_job_id}
        auth = seen.headers["authorization"]
        assert auth.startswith(f"AWS4-HMAC-SHA256 Credential={aws_env['AWS_ACCESS_KEY_ID']}/")
        assert f"/{REGION}/states/aws4_request" in auth
        signed_names = auth.split("SignedHeaders=")[1].split(",")[0].split(";")
        assert {"host", "x-amz-date", "x-amz-target", "content-type", "x-amz-security-token"} <= set(signed_names)
        request = AWSRequest(
            method=seen.method,
            url=f"http://{seen.headers['host']}{seen.path}",
            data=seen.body,
            headers={name: seen.headers[name] for name in signed_names},
        )
        request.context["timestamp"] = seen.headers["x-amz-date"]
        signer = SigV4Auth(creds, "states", REGION)
        expected = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
        assert auth.endswith(f"Signature={expected}")


def test_sfn_throttling_is_a_doubt_replayed_not_a_rejection(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """ThrottlingException (HTTP 400) on the create is ambiguous: the create is replayed with the same
    name, ends with one execution; a DescribeExecution answered ExecutionDoesNotExist is an unknown state."""
    arn = state_machine(moto_url, wait_s=0)
    calls = {"start": 0, "describe": 0}

    def plan(seen: Seen) -> str | bytes:
        if seen.target.endswith(".StartExecution"):
            calls["start"] += 1
            if calls["start"] == 1:
                return aws_answer(
                    400, {"__type": "com.amazon.coral.availability#ThrottlingException", "message": "Rate exceeded"}
                )
        if seen.target.endswith(".DescribeExecution"):
            calls["describe"] += 1
            if calls["describe"] == 1:
                return aws_answer(400, {"__type": "ExecutionDoesNotExist", "message": "Execution Does Not Exist"})
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 4}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert len(executions(moto_url, arn)) == 1
        history = causes(store, op_id)
        assert "ambiguous_create" in history and "definitive_rejection" not in history
        answers = [o["raw"] for o in store.observations(op_id) if o["kind"] == "create_response"]
        assert answers[0]["outcome"] == "ambiguous" and answers[0]["error_class"] == "aws:ThrottlingException"
        polls = [o["raw"] for o in store.observations(op_id) if o["kind"] == "status_poll"]
        assert polls[0]["error_class"] == "aws:ExecutionDoesNotExist"


def test_sfn_replay_refused_for_its_credentials_proves_nothing(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """The create's answer is lost and the first replay is refused (AccessDeniedException): that is not
    proof the original was refused (AWS replays no stored answers), so the next replay adopts the job."""
    arn = state_machine(moto_url, wait_s=1)
    starts = {"n": 0}

    def plan(seen: Seen) -> str | bytes:
        if seen.target.endswith(".StartExecution"):
            starts["n"] += 1
            if starts["n"] == 1:
                return "drop"
            if starts["n"] == 2:
                return aws_answer(400, {"__type": "AccessDeniedException", "message": "not now"})
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 7}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert len(executions(moto_url, arn)) == 1 and starts["n"] == 3
        history = causes(store, op_id)
        assert "proved_absent" not in history and "definitive_rejection" not in history
        answers = [o["raw"] for o in store.observations(op_id) if o["kind"] == "create_response"]
        assert [a["outcome"] for a in answers] == ["ambiguous", "ambiguous", "confirmed"]
        assert answers[1]["error_class"] == "aws:AccessDeniedException"


def test_expired_credentials_are_read_again_and_the_request_signed_again_once(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS refuses the session token (ExpiredTokenException, nothing processed); the adapter reads the
    chain again, finds rotated credentials and sends the same bytes signed with them, once."""
    arn = state_machine(moto_url, wait_s=0)
    rotated = "jtcanarytok_" + secrets.token_hex(12)

    def plan(seen: Seen) -> str | bytes:
        if seen.target.endswith(".StartExecution") and len(proxy.targets("StartExecution")) == 1:
            monkeypatch.setenv("AWS_SESSION_TOKEN", rotated)
            return aws_answer(400, {"__type": "ExpiredTokenException", "message": "The security token expired"})
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 8}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        first, second = proxy.targets("StartExecution")
        assert first.body == second.body
        assert first.headers["x-amz-security-token"] == aws_env["AWS_SESSION_TOKEN"]
        assert second.headers["x-amz-security-token"] == rotated
        assert causes(store, op_id).count("create_attempt") == 1  # one attempt: the refused send did nothing
        held = ledger_bytes(store)
        assert canary_hits(rotated, held) == [] and canary_hits(aws_env["AWS_SESSION_TOKEN"], held) == []


def test_sfn_bad_request_is_a_definitive_rejection(
    db_url: str, moto_url: str, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """A state machine that does not exist is refused by AWS: failed, with the AWS error type named."""
    missing = "arn:aws:states:us-east-1:123456789012:stateMachine:does-not-exist"
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", moto_url, missing), [{"n": 5}])
    with store:
        op = store.get(op_id)
        assert op.state is State.FAILED
        assert "StateMachineDoesNotExist" in (op.state_reason or "")


def test_sfn_a_failed_execution_says_its_error_and_cause_in_the_reason(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """DescribeExecution of a failed execution names its error and cause (moto leaves them out, so the proxy
    answers as AWS does): the reason quotes them, plain, with a credential the cause echoes masked."""
    arn = state_machine(moto_url, wait_s=30)
    cause = f'{{"errorMessage": "Task timed out", "key": "{aws_env["AWS_SECRET_ACCESS_KEY"]}"}}\u0000\u202e'

    def plan(seen: Seen) -> str | bytes:
        if not seen.target.endswith(".DescribeExecution"):
            return "forward"
        arn_asked = json.loads(seen.body)["executionArn"]
        body = {"executionArn": arn_asked, "stateMachineArn": arn, "name": arn_asked.rsplit(":", 1)[1]}
        body |= {"status": "FAILED", "startDate": 1796600000.0, "stopDate": 1796600010.5, "input": "{}"}
        return aws_answer(200, body | {"error": "States.Timeout", "cause": cause})

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 1}])
    with store:
        op = store.get(op_id)
        assert op.state is State.FAILED, op.state_reason
        reason = op.state_reason or ""
        # (their quotation marks escaped: nothing they wrote can end the quotation)
        assert reason.startswith(
            'the provider reports the job FAILED: "States.Timeout: {\\"errorMessage\\": \\"Task timed'
        )
        assert aws_env["AWS_SECRET_ACCESS_KEY"] not in reason and "[REDACTED]" in reason
        assert all(c.isprintable() for c in reason)
        assert canary_hits(aws_env["AWS_SECRET_ACCESS_KEY"], ledger_bytes(store)) == []


def test_sfn_cancel_stops_the_execution(db_url: str, moto_url: str, aws_env: dict[str, str], tmp_path: Path) -> None:
    """A cancel sends StopExecution once; moto reports ABORTED, which ends the operation cancelled."""
    arn = state_machine(moto_url, wait_s=30)
    provider_file = sfn_file(tmp_path / "sfn.toml", moto_url, arn)
    store = Store.open(db_url)
    provider = load_provider(provider_file)

    async def go() -> str:
        jt = AsyncJobtrail(store=store, providers=[provider])
        op = await jt.submit("sfn", {"n": 6})
        worker = Worker(store, {"sfn": provider}, worker_id="w1", idle_s=0.02, lease_s=10)
        runner = asyncio.create_task(worker.run(until_settled=True, timeout=20))
        while (await asyncio.to_thread(store.get, op.operation_id)).state is not State.OBSERVING:
            await asyncio.sleep(0.05)
        await jt.cancel(op.operation_id, requested_by="alice", reason="test")
        await runner
        await provider.aclose()
        return op.operation_id

    op_id = asyncio.run(go())
    with store:
        assert store.get(op_id).state is State.CANCELLED, store.get(op_id).state_reason
        assert [e["status"] for e in executions(moto_url, arn)] == ["ABORTED"]


# -- Athena ----------------------------------------------------------------------------------------


def test_athena_create_status_results_against_moto(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """StartQueryExecution carries ClientRequestToken = the token; GetQueryExecution's state drives the
    operation; GetQueryResults is stored as the result (moto's queued rows)."""
    rows = [{"Data": [{"VarCharValue": "id"}]}, {"Data": [{"VarCharValue": "1"}]}, {"Data": [{"VarCharValue": "2"}]}]
    columns = [
        {"Name": "id", "Type": "integer", "CatalogName": "c", "SchemaName": "s", "TableName": "t", "Label": "id"}
    ]
    queue = urllib.request.Request(
        moto_url + "/moto-api/static/athena/query-results",
        data=json.dumps({"region": REGION, "results": [{"rows": rows, "column_info": columns}]}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(queue) as answer:
        assert answer.status == 201
    path = athena_file(tmp_path / "athena.toml", proxy.url)
    store, (op_id,) = run_in_process(db_url, path, [{"QueryString": "SELECT id FROM t"}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        start = proxy.targets("StartQueryExecution")
        assert len(start) == 1
        assert start[0].headers["content-type"] == "application/x-amz-json-1.1"
        assert json.loads(start[0].body) == {
            "QueryString": "SELECT id FROM t",
            "ClientRequestToken": op.idempotency_token,
            "WorkGroup": "primary",
            "ResultConfiguration": {"OutputLocation": "s3://jobtrail-results/q/"},
        }
        assert "/athena/aws4_request" in start[0].headers["authorization"]
        assert {s.target for s in proxy.seen} == {
            "AmazonAthena.StartQueryExecution",
            "AmazonAthena.GetQueryExecution",
            "AmazonAthena.GetQueryResults",
        }
        _, data = read_result(store, op_id)
        assert json.loads(data) == {"ResultSetMetadata": {"ColumnInfo": columns}, "Rows": rows}
        held = ledger_bytes(store)
        assert canary_hits(aws_env["AWS_SECRET_ACCESS_KEY"], held) == []
        assert canary_hits(aws_env["AWS_SESSION_TOKEN"], held) == []


def test_athena_a_failed_query_says_why_in_the_reason(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """GetQueryExecution of a failed query gives its StateChangeReason (moto never fails a query, so the proxy
    answers as AWS does): the reason quotes it."""

    def plan(seen: Seen) -> str | bytes:
        if not seen.target.endswith(".GetQueryExecution"):
            return "forward"
        status = {"State": "FAILED", "SubmissionDateTime": 1796600000.0, "CompletionDateTime": 1796600001.0}
        status["StateChangeReason"] = "line 1:8: Column 'idd' cannot be resolved"
        status["AthenaError"] = {"ErrorCategory": 2, "ErrorType": 1006, "Retryable": False, "ErrorMessage": "idd"}
        query_id = json.loads(seen.body)["QueryExecutionId"]
        return aws_answer(200, {"QueryExecution": {"QueryExecutionId": query_id, "Status": status}})

    proxy.plan = plan
    path = athena_file(tmp_path / "athena.toml", proxy.url)
    store, (op_id,) = run_in_process(db_url, path, [{"QueryString": "SELECT idd FROM t"}])
    with store:
        op = store.get(op_id)
        assert op.state is State.FAILED, op.state_reason
        assert op.state_reason == "the provider reports the job FAILED: \"line 1:8: Column 'idd' cannot be resolved\""
        assert proxy.targets("GetQueryResults") == []


# -- configuration and the contract check -----------------------------------------------------------


def test_providers_check_states_the_guarantee() -> None:
    """`jobtrail providers check` on the example says at-most-once by replay of the execution name."""
    done = cli("providers", "check", str(EXAMPLES / "aws-stepfunctions.toml"), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "aws-stepfunctions"
    assert report["at_most_once"] is True and report["reconcile"] == ["replay"]
    assert report["guarantees"]["at-most-once creation"]["verdict"] == "yes"
    assert report["token_retention_s"] == 90 * 24 * 3600
    assert "ExecutionAlreadyExists" in report["contract"] and "DescribeExecution" in report["contract"]
    assert report["credential"] == "aws-sigv4:default chain"
    assert report["base_url"] == "https://states.us-east-1.amazonaws.com"
    athena = json.loads(cli("providers", "check", str(EXAMPLES / "aws-athena.toml"), "--json").stdout)
    assert athena["at_most_once"] is True and "ClientRequestToken" in athena["contract"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('credential = "env:AWS_SECRET_ACCESS_KEY"\n', "signed with botocore's credentials"),
        ('[create]\npath = "/x"\n', "'create' is fixed by kind"),
        ('region = "moon"\n', "region: expected an AWS region"),
        ('region = "cn-north-1"\n', "in partition 'aws' but region cn-north-1 is in 'aws-cn'"),
    ],
)
def test_config_mistakes_are_named(tmp_path: Path, extra: str, message: str) -> None:
    """A key the adapter fixes, a credential value and a bad region are refused by name."""
    arn = "arn:aws:states:us-east-1:123456789012:stateMachine:m"
    path = tmp_path / "p.toml"
    path.write_text(f'kind = "aws-stepfunctions"\nstate_machine_arn = "{arn}"\n{extra}', encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_provider(path)


@pytest.mark.parametrize(
    ("config", "service", "expected"),
    [
        (
            'state_machine_arn = "arn:aws:states:us-east-1:123456789012:stateMachine:m"',
            "stepfunctions",
            "https://states.us-east-1.amazonaws.com",
        ),
        (
            'state_machine_arn = "arn:aws-cn:states:cn-north-1:123456789012:stateMachine:m"',
            "stepfunctions",
            "https://states.cn-north-1.amazonaws.com.cn",
        ),
        (
            'state_machine_arn = "arn:aws-us-gov:states:us-gov-west-1:123456789012:stateMachine:m"',
            "stepfunctions",
            "https://states.us-gov-west-1.amazonaws.com",
        ),
        (
            'state_machine_arn = "arn:aws-iso:states:us-iso-east-1:123456789012:stateMachine:m"',
            "stepfunctions",
            "https://states.us-iso-east-1.c2s.ic.gov",
        ),
        ('region = "cn-northwest-1"', "athena", "https://athena.cn-northwest-1.amazonaws.com.cn"),
        ('region = "us-isob-east-1"', "athena", "https://athena.us-isob-east-1.sc2s.sgov.gov"),
        ('region = "eusc-de-east-1"', "athena", "https://athena.eusc-de-east-1.amazonaws.eu"),
    ],
    ids=["aws", "aws-cn", "aws-us-gov", "aws-iso", "athena-aws-cn", "athena-aws-iso-b", "athena-aws-eusc"],
)
def test_the_default_endpoint_is_in_the_region_s_partition(
    tmp_path: Path, config: str, service: str, expected: str
) -> None:
    """Without base_url, requests go to the service's endpoint in the region's partition (amazonaws.com.cn in
    China, c2s.ic.gov and sc2s.sgov.gov in the ISO regions, amazonaws.eu in the European Sovereign Cloud),
    the one botocore itself would call."""
    kind = "aws-stepfunctions" if service == "stepfunctions" else "aws-athena"
    path = tmp_path / "p.toml"
    path.write_text(f'kind = "{kind}"\n{config}\n', encoding="utf-8")
    provider = load_provider(path)
    assert provider.config.base_url == expected
    region = expected.split(".")[1]
    client = boto3.client(service, region_name=region, aws_access_key_id="x", aws_secret_access_key="y")
    assert client.meta.endpoint_url == expected


def test_plain_http_only_to_loopback_and_arn_required(tmp_path: Path) -> None:
    """Signed requests never go over plain HTTP except to loopback; the state machine ARN is checked."""
    arn = "arn:aws:states:us-east-1:123456789012:stateMachine:m"
    path = tmp_path / "p.toml"
    path.write_text(f'kind = "aws-stepfunctions"\nstate_machine_arn = "{arn}"\nbase_url = "http://example.com"\n')
    with pytest.raises(ConfigError, match="https://"):
        load_provider(path)
    path.write_text('kind = "aws-stepfunctions"\nstate_machine_arn = "arn:aws:states:::nope"\n')
    with pytest.raises(ConfigError, match="state_machine_arn"):
        load_provider(path)


def test_athena_lost_create_is_replayed_with_the_same_client_request_token(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """The first StartQueryExecution's answer is lost; the replay sends the same bytes (the same
    ClientRequestToken), which AWS answers with the original QueryExecutionId. (moto ignores the
    token and starts a second query, so here the id adopted is the replay's: AWS's dedupe is not
    provable against moto; what jobtrail sends is.)"""
    dropped: list[bool] = []

    def plan(seen: Seen) -> str:
        if seen.target.endswith(".StartQueryExecution") and not dropped:
            dropped.append(True)
            return "drop"
        return "forward"

    proxy.plan = plan
    path = tmp_path / "athena.toml"
    path.write_text(
        f'kind = "aws-athena"\nname = "athena"\nregion = "{REGION}"\nbase_url = "{proxy.url}"\n' + FAST,
        encoding="utf-8",
    )
    store, (op_id,) = run_in_process(db_url, path, ["SELECT 1"])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        first, second = proxy.targets("StartQueryExecution")
        assert first.body == second.body
        assert json.loads(first.body) == {"QueryString": "SELECT 1", "ClientRequestToken": op.idempotency_token}
        confirmed = [json.loads(e.evidence) for e in store.history(op_id) if e.cause == "confirmed_create"]
        assert confirmed[0]["via"] == "replay"


# -- a provider that lies: answers the adapter must not trust --------------------------------------


def test_athena_query_id_that_echoes_the_secret_is_never_stored(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """StartQueryExecution answered with the secret key as its QueryExecutionId: not confirmed, not stored;
    the replay (same ClientRequestToken) brings moto's real id, and nothing of the secret is in the ledger."""
    lied: list[bool] = []

    def plan(seen: Seen) -> str | bytes:
        if seen.target.endswith(".StartQueryExecution") and not lied:
            lied.append(True)
            return aws_answer(200, {"QueryExecutionId": aws_env["AWS_SECRET_ACCESS_KEY"]})
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, athena_file(tmp_path / "athena.toml", proxy.url), ["SELECT 1"])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert len(proxy.targets("StartQueryExecution")) == 2
        assert op.remote_job_id is not None and "jtcanary" not in op.remote_job_id
        answers = [o["raw"] for o in store.observations(op_id) if o["kind"] == "create_response"]
        assert answers[0]["outcome"] == "ambiguous" and answers[0]["error_class"] == "malformed_response"
        assert canary_hits(aws_env["AWS_SECRET_ACCESS_KEY"], ledger_bytes(store)) == []


def test_sfn_status_fields_that_echo_the_credential_are_not_stored(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """DescribeExecution answers a stopDate that is the secret key and a startDate that is the session token
    (AWS sends epoch numbers): the provider time is not taken from them, and neither reaches the ledger."""
    arn = state_machine(moto_url, wait_s=0)

    def plan(seen: Seen) -> str | bytes:
        if not seen.target.endswith(".DescribeExecution"):
            return "forward"
        asked = json.loads(seen.body)["executionArn"]
        body = {"executionArn": asked, "stateMachineArn": arn, "status": "SUCCEEDED", "input": '{"n":1}'}
        lies = {"stopDate": aws_env["AWS_SECRET_ACCESS_KEY"], "startDate": aws_env["AWS_SESSION_TOKEN"]}
        return aws_answer(200, body | lies | {"output": '{"ok":true}'})

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 1}])
    with store:
        op = store.get(op_id)
        assert op.state is State.SUCCEEDED, op.state_reason
        assert proxy.targets("DescribeExecution")
        held = ledger_bytes(store)
        assert canary_hits(aws_env["AWS_SECRET_ACCESS_KEY"], held) == []
        assert canary_hits(aws_env["AWS_SESSION_TOKEN"], held) == []


def test_sfn_a_status_of_another_execution_is_not_taken_for_ours(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """DescribeExecution answers SUCCEEDED for an execution that is not ours: an unknown state, never our
    success, and no result is collected from it."""
    arn = state_machine(moto_url, wait_s=0)

    def plan(seen: Seen) -> str | bytes:
        if not seen.target.endswith(".DescribeExecution"):
            return "forward"
        other = json.loads(seen.body)["executionArn"] + "-someone-else"
        return aws_answer(200, {"executionArn": other, "status": "SUCCEEDED", "output": '{"not":"ours"}'})

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 1}], seconds=2)
    with store:
        op = store.get(op_id)
        assert op.state in (State.ACCEPTED, State.OBSERVING), op.state_reason
        assert len(proxy.targets("DescribeExecution")) >= 2
        polls = [o["raw"] for o in store.observations(op_id) if o["kind"] == "status_poll"]
        assert polls and all(p["error_class"] == "another_execution" for p in polls)


def test_sfn_output_details_of_the_wrong_type_do_not_crash_the_collect(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """A SUCCEEDED execution without output whose outputDetails is a string (not the object AWS sends): the
    collect says there is no output and asks again, instead of failing with AttributeError on every try."""
    arn = state_machine(moto_url, wait_s=0)

    def plan(seen: Seen) -> str | bytes:
        if not seen.target.endswith(".DescribeExecution"):
            return "forward"
        asked = json.loads(seen.body)["executionArn"]
        return aws_answer(200, {"executionArn": asked, "status": "SUCCEEDED", "outputDetails": "included"})

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", proxy.url, arn), [{"n": 1}], seconds=2)
    with store:
        op = store.get(op_id)
        assert op.state is State.RESULT_COLLECTING, op.state_reason
        assert "AttributeError" not in (op.state_reason or "")
        assert len(proxy.targets("DescribeExecution")) >= 3  # the status, then the fetches asked again
        fetches = [o for o in store.observations(op_id) if o["kind"] == "result_fetch"]
        assert fetches and "no_output" in json.dumps(fetches[-1]["raw"])


def test_athena_result_pages_that_never_end_are_refused_not_read_for_ever(
    db_url: str, moto_url: str, proxy: Proxy, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """GetQueryResults hands out NextToken A, then B, then A again: the collect stops at the token already
    followed and ends result_unavailable saying why (it used to read the circle for ever, holding the worker)."""
    pages: list[str | None] = []

    def plan(seen: Seen) -> str | bytes:
        if seen.target.endswith(".GetQueryExecution"):
            qid = json.loads(seen.body)["QueryExecutionId"]
            return aws_answer(200, {"QueryExecution": {"QueryExecutionId": qid, "Status": {"State": "SUCCEEDED"}}})
        if seen.target.endswith(".GetQueryResults"):
            token = json.loads(seen.body).get("NextToken")
            pages.append(token)
            following = {None: "A", "A": "B", "B": "A"}[token]
            return aws_answer(200, {"ResultSet": {"Rows": [], "ResultSetMetadata": {}}, "NextToken": following})
        return "forward"

    proxy.plan = plan
    store, (op_id,) = run_in_process(db_url, athena_file(tmp_path / "athena.toml", proxy.url), ["SELECT 1"], seconds=10)
    with store:
        op = store.get(op_id)
        assert op.state is State.RESULT_UNAVAILABLE, op.state_reason
        assert "NextToken already followed" in (op.state_reason or "")
        assert pages == [None, "A", "B"]


def test_a_clock_off_by_twenty_minutes_is_corrected_from_aws_s_date_not_a_failed_operation(
    db_url: str, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """A strict endpoint whose clock is 20 minutes ahead refuses a request signed at our time
    (InvalidSignatureException "Signature expired", with its own Date): the adapter signs again on AWS's
    clock (as botocore and the SDKs do) and the execution starts, once; it used to end failed with "fix the
    credentials". Then the clocks agree again (this machine's was put right): the offset learnt is let go at
    the next refusal, not kept for ever (a review found every later request refused until a restart)."""
    import email.utils
    from datetime import UTC, datetime

    from aiohttp import web

    clock = {"ahead_s": 1200.0}
    sm = f"arn:aws:states:{REGION}:123456789012:stateMachine:skewed"
    seen: list[tuple[str, str]] = []  # (action, X-Amz-Date)
    refused: list[str] = []
    started: set[str] = set()

    async def handle(request: web.Request) -> web.Response:
        action = request.headers["X-Amz-Target"].rsplit(".", 1)[1]
        stamp = request.headers["X-Amz-Date"]
        seen.append((action, stamp))
        now = time.time() + clock["ahead_s"]
        signed = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()
        headers = {"Date": email.utils.formatdate(now, usegmt=True)}
        if abs(signed - now) > 300:
            refused.append(action)
            body = {"__type": "InvalidSignatureException", "message": f"Signature expired: {stamp} is now earlier"}
            return web.json_response(body, status=400, headers=headers)
        payload = json.loads(await request.read())
        if action == "StartExecution":
            execution = sm.replace(":stateMachine:", ":execution:") + ":" + payload["name"]
            started.add(execution)
            clock["ahead_s"] = 0.0  # from now on the two clocks agree
            return web.json_response({"executionArn": execution, "startDate": now}, headers=headers)
        body = {"executionArn": payload["executionArn"], "status": "SUCCEEDED", "output": '{"ok":1}', "input": "{}"}
        return web.json_response(body, headers=headers)

    async def serve() -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    runner, url = asyncio.run_coroutine_threadsafe(serve(), loop).result()
    try:
        store, (op_id,) = run_in_process(db_url, sfn_file(tmp_path / "sfn.toml", url, sm), [{}], seconds=5)
        with store:
            op = store.get(op_id)
            assert op.state is State.SUCCEEDED, op.state_reason
            assert causes(store, op_id).count("create_attempt") == 1
            assert len(started) == 1
            starts = [stamp for action, stamp in seen if action == "StartExecution"]
            assert len(starts) == 2  # refused for its time, then signed on AWS's clock
            assert all(action == "StartExecution" for action, _ in seen[:2])
            # the clocks agree again: the first status read, signed with the old offset, is refused once and
            # signed again on this machine's time; every later call is accepted at once
            assert refused == ["StartExecution", "DescribeExecution"], refused
            assert len([a for a, _ in seen if a == "DescribeExecution"]) == len(seen) - 2
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        serving.join(5)
        loop.close()  # (left open, its sockets were reported unclosed in whichever test ran next)
