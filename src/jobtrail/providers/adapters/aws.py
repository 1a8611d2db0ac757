"""Built-in adapters for AWS: ``kind = "aws-stepfunctions"`` and ``kind = "aws-athena"``.

Both speak the AWS JSON protocol: every call is ``POST /`` with its own
``X-Amz-Target`` and a JSON body, signed with botocore's SigV4 signer over the
exact bytes sent. Credentials come from botocore's usual chain (environment,
shared files, SSO, container or instance roles), optionally a named profile;
they are resolved off the event loop, refreshed as botocore refreshes them, and
the secret key and session token are registered with the redactor the moment
they are read, so they never reach the ledger or a log. botocore signs and
finds credentials; the wire is the adapter's own aiohttp client (egress rules,
bounded reads, one connection pool for every operation).

Step Functions (STANDARD workflows): the execution ``name`` is the operation's
idempotency token. StartExecution with the same name and input answers with the
same execution while it runs, so a replay is the reconciliation; once it has
closed, the replay is answered ``ExecutionAlreadyExists``, which is not a
rejection: the adapter reads the execution named by our token
(``arn:...:execution:<state machine>:<token>``) and adopts it if its input is
ours. The result is the execution's ``output``.

Athena: the token travels as ``ClientRequestToken`` (botocore's service model
marks StartQueryExecution idempotent and the field an idempotency token, 32 to
128 characters; AWS keeps no published retention for it). The result is every
page of GetQueryResults, joined into one JSON document.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import math
import re
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from jobtrail.domain.canonical import compact_json, parse_answer, parse_json
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import unusable, unusable_id
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import Redactor, Secret
from jobtrail.domain.states import RemoteState, State
from jobtrail.domain.words import why_it_ended
from jobtrail.providers.contract import CreateOutcome, NoAnswer, Response, Spooled, StatusOutcome, WireAnswer
from jobtrail.providers.credentials import Credential
from jobtrail.providers.declared import is_loopback
from jobtrail.providers.http import HttpProvider, parse_config
from jobtrail.providers.kinds import operator_settings

#: how long Step Functions keeps a STANDARD execution's name after it closes (the name cannot be reused before)
SFN_NAME_RETENTION_S = 90 * 24 * 3600
#: GetQueryResults' largest page
_ATHENA_PAGE = 1000
#: pages of one result read at most: a provider that hands out a new NextToken forever (empty pages take
#: no room against max_bytes) would otherwise hold the collect, and its worker, for ever
_ATHENA_MAX_PAGES = 10_000
#: SigV4 refuses a request signed more than 5 minutes from AWS's clock; past this, our clock is off
_SKEW_S = 240
#: a request refused for its time is signed again only if the time it would be signed at moves this much
_RESIGN_S = 60
#: the error types AWS answers a request signed at the wrong time with (botocore and the other SDKs
#: correct their clock from the answer's Date header and sign again, as _transport does)
_CLOCK_ERRORS = frozenset(
    {
        "InvalidSignatureException",
        "SignatureDoesNotMatch",
        "RequestTimeTooSkewed",
        "RequestExpired",
        "RequestInTheFuture",
    }
)
#: error types that mean "not now", never "no": the request may be repeated with the same token
_RETRYABLE = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "ProvisionedThroughputExceededException",
        "KmsThrottlingException",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "InternalServerError",
        "InternalServerException",
        "InternalFailure",
        "ExecutionLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
    }
)
#: error types that say the credentials were refused (re-read once, as botocore would refresh them)
_CREDENTIAL_ERRORS = frozenset(
    {
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidSignatureException",
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "MissingAuthenticationToken",
    }
)
#: refusals of the request's own form: the same bytes were refused the first time too
_MALFORMED = frozenset(
    {
        "ValidationException",
        "SerializationException",
        "InvalidArn",
        "InvalidName",
        "InvalidExecutionInput",
        "InvalidParameterValueException",
        "MissingRequiredParameter",
    }
)
_SM_ARN = re.compile(
    r"^arn:(?P<partition>[a-z-]+):states:(?P<region>[a-z0-9-]+):(?P<account>\d{12}):stateMachine:(?P<name>[^:]+)(:[^:]+)?$"
)
#: a region name: "us-east-1", "cn-north-1", "us-isob-east-1", "eusc-de-east-1" (the sovereign cloud's)
_REGION = re.compile(r"^[a-z]{2,4}(-[a-z]+)+-\d+$")


def aws_error(resp: Response) -> tuple[str | None, str]:
    """The AWS error type (``__type`` without its namespace, or ``X-Amzn-ErrorType``) and message."""
    body = resp.body if isinstance(resp.body, dict) else {}
    raw = body.get("__type") or next((v for k, v in resp.headers.items() if k.lower() == "x-amzn-errortype"), None)
    if not isinstance(raw, str) or not raw:
        return None, ""
    kind = raw.rsplit("#", 1)[-1].split(":", 1)[0]
    message = body.get("message") or body.get("Message") or ""
    return kind, str(message)[:500]


class AwsJsonProvider(HttpProvider):
    """What both AWS adapters share: SigV4 over the exact bytes, the JSON protocol, AWS error types."""

    #: botocore's signing name of the service
    service = ""
    #: the X-Amz-Target prefix and the JSON protocol version
    target_prefix = ""
    content_type = ""

    def __init__(self, config: Any, *, region: str, profile: str | None) -> None:
        super().__init__(config)
        self.region = region
        self.profile = profile
        #: botocore's credentials object (refreshable ones refresh themselves), found once off the loop
        self._aws_credentials: Any = None
        self._registered: set[str] = set()
        #: seconds AWS's clock is ahead of ours, learnt from a request refused for its time (see _transport)
        self._clock_offset_s = 0.0

    # -- credentials and signing -------------------------------------------------------------

    async def _credential_headers(self) -> dict[str, str]:
        # no header credential: every request is signed in _transport instead
        return {}

    def _find_credentials(self) -> Any:
        import botocore.session  # type: ignore[import-untyped]
        from botocore.exceptions import BotoCoreError  # type: ignore[import-untyped]

        try:
            found = botocore.session.Session(profile=self.profile).get_credentials()
        except BotoCoreError as exc:
            raise ConfigError(f"provider {self.name}: AWS credentials could not be read ({exc})") from None
        if found is None:
            where = f"profile {self.profile!r}" if self.profile else "botocore's default chain"
            raise ConfigError(
                f"provider {self.name}: no AWS credentials found in {where} (set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or aws_profile in the provider file, or run `aws configure`)"
            )
        return found

    async def _frozen(self, *, again: bool = False) -> Any:
        """Current credentials (access key, secret key, token); read or refreshed off the event loop."""
        if self._aws_credentials is None or again:
            self._aws_credentials = await asyncio.to_thread(self._find_credentials)
        creds = self._aws_credentials
        needs = getattr(creds, "refresh_needed", None)
        frozen = (
            await asyncio.to_thread(creds.get_frozen_credentials)
            if needs and needs()
            else (creds.get_frozen_credentials())
        )
        for value in (frozen.secret_key, frozen.token):
            if value and value not in self._registered:
                Secret(value, redactor=self.redactor)  # registers it (and its encodings) with the provider's redactor
                self._registered.add(value)
        return frozen

    def _signed(self, method: str, url: str, headers: Mapping[str, str], payload: bytes, frozen: Any) -> dict[str, str]:
        from botocore.auth import SigV4Auth  # type: ignore[import-untyped]
        from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]

        request = AWSRequest(method=method, url=url, data=payload, headers=dict(headers))
        signer = SigV4Auth(frozen, self.service, self.region)
        if self._clock_offset_s:
            _add_auth_at(signer, request, self._clock_offset_s)
        else:
            signer.add_auth(request)
        return {str(k): str(v) for k, v in request.headers.items()}

    async def _transport(
        self, method: str, url: str, headers: Mapping[str, str], body: Any, max_bytes: int
    ) -> WireAnswer | NoAnswer:
        """Sign the exact bytes, send them; a refused credential is re-read and the request signed again once."""
        payload = body if isinstance(body, bytes) else compact_json(body).encode("utf-8")
        try:
            frozen = await self._frozen()
        except ConfigError as exc:
            return NoAnswer("not_sent", str(exc))
        answer = await self._signed_send(method, url, headers, payload, max_bytes, frozen)
        learnt = _clock_offset(answer)
        if learnt is not None:
            # refused for its time, not its key (nothing was processed): AWS's Date says how far its clock is
            # from ours now, the offset learnt before included (it goes once our clock is put right, or was
            # never wrong: a stale offset would have every later request refused); sign again on the time that
            # gives, once, if it is another
            before, self._clock_offset_s = self._clock_offset_s, learnt if abs(learnt) > _SKEW_S else 0.0
            if abs(self._clock_offset_s - before) > _RESIGN_S:
                answer = await self._signed_send(method, url, headers, payload, max_bytes, frozen)
        if isinstance(answer, WireAnswer) and answer.status in (400, 403) and _credential_refused(answer.body):
            try:
                fresh = await self._frozen(again=True)
            except ConfigError:
                return answer
            if (fresh.access_key, fresh.secret_key, fresh.token) != (
                frozen.access_key,
                frozen.secret_key,
                frozen.token,
            ):
                answer = await self._signed_send(method, url, headers, payload, max_bytes, fresh)
        return answer

    async def _signed_send(
        self, method: str, url: str, headers: Mapping[str, str], payload: bytes, max_bytes: int, frozen: Any
    ) -> WireAnswer | NoAnswer:
        signed = self._signed(method, url, headers, payload, frozen)
        return await self._exchange(method, url, max_bytes, headers=signed, data=payload)

    async def _call(
        self, action: str, op: Operation, payload: Mapping[str, Any], *, max_bytes: int | None = None
    ) -> Response | NoAnswer:
        """One AWS JSON call: POST / with its own target header and its own body."""
        extra = {"X-Amz-Target": f"{self.target_prefix}.{action}", "Content-Type": self.content_type}
        data = json.dumps(dict(payload), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        kwargs: dict[str, Any] = {} if max_bytes is None else {"max_bytes": max_bytes}
        sent = await self._send("POST", self.config.base_url + "/", op, body=data, extra_headers=extra, **kwargs)
        if isinstance(sent, Response):
            request_id = next(
                (v for k, v in sent.headers.items() if k.lower() in ("x-amzn-requestid", "x-amz-request-id")), None
            )
            if request_id and not sent.provider_request_id:
                sent = dataclasses.replace(sent, provider_request_id=request_id)
        return sent

    # -- shared classification ------------------------------------------------------------------

    def _classify_error(self, op: Operation, resp: Response) -> CreateOutcome:
        """A create answered with an AWS error: throttling and server trouble are doubts, the rest refusals.

        A replay (reconciliation) refused for anything but the request's own form proves nothing about the
        original: AWS does not store and replay answers the way IETF idempotency keys do, so a refused
        credential or permission now says nothing about what the lost attempt did.
        """
        status = resp.http_status or 0
        kind, message = aws_error(resp)
        detail = f"HTTP {status} {kind or 'without an AWS error type'}" + (f": {message}" if message else "")
        if 300 <= status < 400:
            return self.classify_create(resp)  # never followed: a person checks base_url (see HttpProvider)
        if status < 400:
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class=f"http_{status}",
                detail=f"HTTP {status} where AWS answers 200; the job may exist",
            )
        if status >= 500 or status in (408, 429) or (kind in _RETRYABLE):
            return CreateOutcome(kind="ambiguous", response=resp, error_class=f"aws:{kind or status}", detail=detail)
        if op.state is State.RECONCILIATION and kind not in _MALFORMED:
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class=f"aws:{kind or status}",
                detail=detail + "; a refused replay says nothing about whether the lost attempt started a job",
            )
        if kind in _CLOCK_ERRORS and _about_time(message):
            # refused for its time even as signed on the clock AWS's Date gave: nothing was started, and a
            # later try (or a clock put right) can settle it; not a refusal of the request
            clock = (
                f"this machine's clock is {self._clock_offset_s:+.0f} s from AWS's: put it right (NTP)"
                if self._clock_offset_s
                else "AWS's Date agrees with this machine's clock, so the refusal is AWS's (or a proxy's) to explain"
            )
            return CreateOutcome(
                kind="not_sent",
                response=resp,
                error_class=f"aws:{kind}",
                detail=f"{detail}; AWS refused the request's time: {clock}",
            )
        if kind in _CREDENTIAL_ERRORS or status in (401, 403):
            detail += (
                "; AWS refused the credentials, so nothing was started: fix the credentials "
                f"({('profile ' + self.profile) if self.profile else 'default chain'}) and submit again"
            )
        return CreateOutcome(kind="rejected", response=resp, error_class=f"aws:{kind or status}", detail=detail)

    def _status_error(self, resp: Response) -> str:
        kind, _ = aws_error(resp)
        return f"aws:{kind}" if kind else f"http_{resp.http_status}"


class StepFunctionsProvider(AwsJsonProvider):
    """``kind = "aws-stepfunctions"``: StartExecution, DescribeExecution, StopExecution."""

    kind = "aws-stepfunctions"
    service = "states"
    target_prefix = "AWSStepFunctions"
    content_type = "application/x-amz-json-1.0"
    contract_note = (
        "StartExecution with name = the idempotency token: AWS answers a repeat with the same name and input "
        "with the same execution while it runs, and with ExecutionAlreadyExists once it closed, which the "
        "adapter settles by DescribeExecution of arn:...:execution:<state machine>:<token> (adopted if its "
        "input is ours, else a person decides). Names stay taken for 90 days after an execution closes. "
        "STANDARD workflows only (EXPRESS executions are not idempotent and cannot be described). "
        "Requests are signed with botocore's SigV4 over the exact bytes sent; credentials from botocore's chain."
    )

    def __init__(self, config: Any, *, region: str, profile: str | None, partition: str) -> None:
        # (the provider file's state machine is the config's target: a submit's when it names none)
        super().__init__(config, region=region, profile=profile)
        self._partition = partition

    def check_request(self, request: Any) -> Any:
        """Any JSON value: it is the execution's input (the name, jobtrail's token, is set beside it)."""
        return request

    def check_target(self, target: str) -> None:
        """A state machine ARN in this provider's partition and region (the endpoint and the signature are
        the region's): each operation's execution is started on the machine its record names, on every
        attempt, whatever the provider file says by then."""
        if self._machine(target) is None:
            raise ConfigError(
                f"target {target!r} is not a state machine of this provider's region: expected "
                f"arn:{self._partition}:states:{self.region}:<account>:stateMachine:<name> (the default is the "
                "provider file's state_machine_arn)"
            )

    def _machine(self, target: str) -> re.Match[str] | None:
        m = _SM_ARN.match(target)
        return m if m is not None and (m["partition"], m["region"]) == (self._partition, self.region) else None

    def execution_arn(self, op: Operation) -> str:
        """The execution our token names on the operation's own state machine (a version or alias ARN starts
        executions of the same machine)."""
        m = self._machine(op.target)
        if m is None:  # (recorded before targets were checked at submit; create refuses it first)
            return ""
        return f"arn:{m['partition']}:states:{m['region']}:{m['account']}:execution:{m['name']}:{op.idempotency_token}"

    @staticmethod
    def execution_input(op: Operation) -> str:
        """The request body as the execution's input: the same bytes on every attempt of one operation."""
        return compact_json(op.request_body)

    async def create(self, op: Operation) -> CreateOutcome:
        if self._machine(op.target) is None:
            return CreateOutcome(
                kind="ambiguous",
                error_class="target_not_a_state_machine",
                detail=f"the operation's target {op.target!r} names no state machine of region {self.region}; "
                "nothing was sent. A person decides: cancel it, and submit again with a state machine ARN as "
                "its target",
                person_must_decide=True,
            )
        sent = await self._call(
            "StartExecution",
            op,
            {
                # the machine the record names: a replay after the provider file changed still goes where
                # the first attempt went (an execution name is unique per state machine only)
                "stateMachineArn": op.target,
                "name": op.idempotency_token,
                "input": self.execution_input(op),
            },
        )
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        status = sent.http_status or 0
        if status == 200:
            arn = sent.body.get("executionArn") if isinstance(sent.body, dict) else None
            if isinstance(arn, str) and arn:
                if arn != self.execution_arn(op):
                    return CreateOutcome(
                        kind="ambiguous",
                        response=sent,
                        error_class="unexpected_execution_arn",
                        detail=f"StartExecution answered {arn}, not the execution our token names "
                        f"({self.execution_arn(op)})",
                    )
                return CreateOutcome(kind="confirmed", response=sent, remote_job_id=arn)
            return CreateOutcome(
                kind="ambiguous",
                response=sent,
                error_class="malformed_response",
                detail="HTTP 200 without executionArn; the execution may exist",
            )
        kind, _ = aws_error(sent)
        if kind == "ExecutionAlreadyExists":
            return await self._already_exists(op, sent)
        return self._classify_error(op, sent)

    async def _already_exists(self, op: Operation, refused: Response) -> CreateOutcome:
        """The name is taken: by our own (closed) execution, which we adopt, or by another input."""
        arn = self.execution_arn(op)
        described = await self._call("DescribeExecution", op, {"executionArn": arn})
        first = {"StartExecution": refused.body}
        if isinstance(described, NoAnswer):
            return CreateOutcome(
                kind="ambiguous",
                response=dataclasses.replace(refused, body=first),
                error_class=f"describe_{described.error_class}",
                detail=f"ExecutionAlreadyExists, and DescribeExecution of {arn} got no answer ({described.detail})",
            )
        body = described.body if isinstance(described.body, dict) else {}
        kept = dataclasses.replace(described, body=first | {"DescribeExecution": _trimmed(body)})
        if described.http_status != 200:
            return CreateOutcome(
                kind="ambiguous",
                response=kept,
                error_class=f"describe_{self._status_error(described)}",
                detail=f"ExecutionAlreadyExists, and DescribeExecution of {arn} answered HTTP {described.http_status}",
            )
        if body.get("executionArn") == arn and _same_json(body.get("input"), self.execution_input(op)):
            return CreateOutcome(
                kind="confirmed",
                response=kept,
                remote_job_id=arn,
                detail=f"ExecutionAlreadyExists: the execution our token names is ours (same input, "
                f"{body.get('status')}); adopted",
            )
        return CreateOutcome(
            kind="ambiguous",
            response=kept,
            person_must_decide=True,
            error_class="execution_name_taken",
            detail=f"the execution name {op.idempotency_token} is taken by {arn} with a different input: "
            "it is not this operation's execution, and no second one can be started under this token; a "
            "person must look at it and resolve",
        )

    async def status(self, op: Operation) -> StatusOutcome:
        sent = await self._call("DescribeExecution", op, {"executionArn": op.remote_job_id or self.execution_arn(op)})
        if isinstance(sent, NoAnswer):
            return StatusOutcome(remote_state=RemoteState.UNKNOWN, raw_state=None, error_class=sent.error_class)
        body = sent.body if isinstance(sent.body, dict) else {}
        kept = dataclasses.replace(sent, body=_trimmed(body))
        if sent.http_status != 200:
            return StatusOutcome(
                remote_state=RemoteState.UNKNOWN, raw_state=None, response=kept, error_class=self._status_error(sent)
            )
        theirs = body.get("executionArn")
        if theirs is not None and theirs != (op.remote_job_id or self.execution_arn(op)):
            return StatusOutcome(
                remote_state=RemoteState.UNKNOWN, raw_state=None, response=kept, error_class="another_execution"
            )
        raw = _word(body.get("status"), self.redactor)
        when = _stamp(body.get("stopDate"), body.get("redriveDate"), body.get("startDate"))
        remote = self.capabilities.normalise(raw)
        # a failed, timed-out or aborted execution names its error and cause (States.TaskFailed: ...)
        said = [text for text in (body.get("error"), body.get("cause")) if isinstance(text, str) and text]
        return StatusOutcome(
            remote_state=remote,
            raw_state=raw,
            response=kept,
            provider_time=when,
            failure=why_it_ended(remote, lambda: ": ".join(said), self.redactor),
        )

    async def cancel(self, op: Operation) -> Response | NoAnswer:
        sent = await self._call(
            "StopExecution",
            op,
            {
                "executionArn": op.remote_job_id or self.execution_arn(op),
                "cause": f"cancelled by jobtrail ({op.operation_id})",
            },
        )
        return sent

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        """DescribeExecution's ``output`` (a JSON text), as the result's bytes."""
        limit = self.result_spec.max_bytes
        sent = await self._call(
            "DescribeExecution",
            op,
            {"executionArn": op.remote_job_id or self.execution_arn(op)},
            max_bytes=4 * limit + 65536,
        )
        if isinstance(sent, NoAnswer):
            return sent
        body = sent.body if isinstance(sent.body, dict) else {}
        if sent.http_status != 200:
            return dataclasses.replace(sent, body={"error": self._status_error(sent), "detail": aws_error(sent)[1]})
        output = body.get("output")
        theirs = body.get("executionArn")
        if theirs is not None and theirs != (op.remote_job_id or self.execution_arn(op)):
            return dataclasses.replace(
                sent,
                http_status=None,
                body={"error": "another_execution", "detail": "DescribeExecution answered for another execution"},
            )
        if body.get("status") != "SUCCEEDED" or not isinstance(output, str):
            details = body.get("outputDetails")
            truncated = isinstance(details, dict) and details.get("included") is False
            return dataclasses.replace(
                sent,
                http_status=None,
                body={
                    "error": "no_output",
                    "detail": f"execution is {body.get('status')}"
                    + ("; its output was not included (outputDetails.included = false)" if truncated else "")
                    + " and DescribeExecution carries no output",
                },
            )
        return Response(
            http_status=200,
            headers={"content-type": "application/json"},
            provider_request_id=sent.provider_request_id,
            raw=output.encode("utf-8"),
        )


class AthenaProvider(AwsJsonProvider):
    """``kind = "aws-athena"``: StartQueryExecution, GetQueryExecution, StopQueryExecution, GetQueryResults."""

    kind = "aws-athena"
    service = "athena"
    target_prefix = "AmazonAthena"
    content_type = "application/x-amz-json-1.1"
    contract_note = (
        "StartQueryExecution with ClientRequestToken = the idempotency token (botocore's model marks the call "
        "idempotent and the field an idempotency token): a replay answers with the same QueryExecutionId. AWS "
        "publishes no retention for the token. The result is every page of GetQueryResults joined into one "
        "JSON document. Requests are signed with botocore's SigV4 over the exact bytes sent."
    )
    #: request keys a caller may set; WorkGroup and ResultConfiguration are the operator's, the token ours
    REQUEST_KEYS = frozenset(
        {
            "QueryString",
            "QueryExecutionContext",
            "ExecutionParameters",
            "ResultReuseConfiguration",
            "EngineConfiguration",
        }
    )

    def __init__(
        self, config: Any, *, region: str, profile: str | None, work_group: str | None, output_location: str | None
    ) -> None:
        super().__init__(config, region=region, profile=profile)
        self.work_group = work_group
        self.output_location = output_location

    def check_request(self, request: Any) -> dict[str, Any]:
        """The query text, or an object with QueryString (and the keys a caller may set)."""
        body = request
        if isinstance(body, str):
            body = {"QueryString": body}
        if not isinstance(body, dict) or not isinstance(body.get("QueryString"), str):
            raise ConfigError(
                f"provider {self.name}: an Athena request is the query text, or an object with QueryString "
                f"(and optionally {', '.join(sorted(self.REQUEST_KEYS - {'QueryString'}))})"
            )
        unknown = sorted(set(body) - self.REQUEST_KEYS)
        if unknown:
            raise ConfigError(
                f"provider {self.name}: request key {unknown[0]!r} is not for the caller to set (WorkGroup and "
                "ResultConfiguration come from the provider file, ClientRequestToken is jobtrail's)"
            )
        return dict(body)

    def start_request(self, op: Operation) -> dict[str, Any]:
        payload = self.check_request(op.request_body) | {"ClientRequestToken": op.idempotency_token}
        if self.work_group:
            payload["WorkGroup"] = self.work_group
        if self.output_location:
            payload["ResultConfiguration"] = {"OutputLocation": self.output_location}
        return payload

    async def create(self, op: Operation) -> CreateOutcome:
        sent = await self._call("StartQueryExecution", op, self.start_request(op))
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        if sent.http_status == 200:
            qid = sent.body.get("QueryExecutionId") if isinstance(sent.body, dict) else None
            why = unusable_id(qid, self.redactor) if isinstance(qid, str) else None
            if isinstance(qid, str) and why is None:
                return CreateOutcome(kind="confirmed", response=sent, remote_job_id=qid)
            # an id that echoes the credential (or would show as other text) is never stored: the replay of
            # the same ClientRequestToken answers with the same id, so it is a doubt, not a new query
            return CreateOutcome(
                kind="ambiguous",
                response=sent,
                error_class="malformed_response",
                detail="HTTP 200 without QueryExecutionId; the query may exist"
                if why is None and not isinstance(qid, str)
                else f"HTTP 200 with an unusable QueryExecutionId ({why or 'not a string'}; not stored); "
                "the query may exist",
            )
        return self._classify_error(op, sent)

    async def status(self, op: Operation) -> StatusOutcome:
        sent = await self._call("GetQueryExecution", op, {"QueryExecutionId": op.remote_job_id or ""})
        if isinstance(sent, NoAnswer):
            return StatusOutcome(remote_state=RemoteState.UNKNOWN, raw_state=None, error_class=sent.error_class)
        if sent.http_status != 200:
            return StatusOutcome(
                remote_state=RemoteState.UNKNOWN, raw_state=None, response=sent, error_class=self._status_error(sent)
            )
        execution = sent.body.get("QueryExecution") if isinstance(sent.body, dict) else None
        state_block = execution.get("Status") if isinstance(execution, dict) else None
        status_block: dict[str, Any] = state_block if isinstance(state_block, dict) else {}
        theirs = execution.get("QueryExecutionId") if isinstance(execution, dict) else None
        if theirs is not None and theirs != op.remote_job_id:
            return StatusOutcome(
                remote_state=RemoteState.UNKNOWN, raw_state=None, response=sent, error_class="another_query"
            )
        raw = _word(status_block.get("State"), self.redactor)
        when = _stamp(status_block.get("CompletionDateTime"), status_block.get("SubmissionDateTime"))
        remote = self.capabilities.normalise(raw)
        # a failed or cancelled query says why: the state change's reason, else its error's message
        return StatusOutcome(
            remote_state=remote,
            raw_state=raw,
            response=sent,
            provider_time=when,
            failure=why_it_ended(
                remote, lambda: status_block.get("StateChangeReason") or status_block.get("AthenaError"), self.redactor
            ),
        )

    async def cancel(self, op: Operation) -> Response | NoAnswer:
        sent = await self._call("StopQueryExecution", op, {"QueryExecutionId": op.remote_job_id or ""})
        return sent

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        """Every page of GetQueryResults, as ``{"ResultSetMetadata": ..., "Rows": [...all pages...]}``."""
        limit = self.result_spec.max_bytes
        rows: list[Any] = []
        metadata: Any = None
        size = 0
        next_token: str | None = None
        last: Response | None = None
        pages = 0
        tokens: set[str] = set()
        while True:
            payload: dict[str, Any] = {"QueryExecutionId": op.remote_job_id or "", "MaxResults": _ATHENA_PAGE}
            if next_token:
                payload["NextToken"] = next_token
            sent = await self._call("GetQueryResults", op, payload, max_bytes=limit)
            if isinstance(sent, NoAnswer):
                return NoAnswer(sent.error_class, sent.detail, {"pages_read": str(pages)})
            if sent.http_status != 200:
                _, message = aws_error(sent)
                return dataclasses.replace(
                    sent, body={"error": self._status_error(sent), "detail": message, "pages_read": pages}
                )
            body = sent.body if isinstance(sent.body, dict) else {}
            result_set = body.get("ResultSet") if isinstance(body.get("ResultSet"), dict) else None
            if result_set is None or not isinstance(result_set.get("Rows", []), list):
                return dataclasses.replace(
                    sent,
                    http_status=None,
                    body={"error": "malformed_page", "detail": "no ResultSet.Rows", "pages_read": pages},
                )
            pages += 1
            last = sent
            if metadata is None:
                metadata = result_set.get("ResultSetMetadata")
            page_rows = result_set.get("Rows", [])
            rows.extend(page_rows)
            size += len(compact_json(page_rows))
            if size > limit:
                return dataclasses.replace(
                    sent,
                    http_status=None,
                    body={"error": "too_large", "detail": f"the result passed {limit} bytes at page {pages}"},
                )
            token = body.get("NextToken")
            if not isinstance(token, str) or not token:
                break
            if token in tokens or pages >= _ATHENA_MAX_PAGES:
                # a token seen before leads round in a circle, and AWS's pages end: nothing is stored from
                # a result that was not read to its end
                # ("refused": reading it again would go round the same way; the collect ends and says why)
                why = "handed out a NextToken already followed" if token in tokens else f"passed {pages} pages"
                return NoAnswer(
                    "refused",
                    f"GetQueryResults {why}: the result has no end to read to, so nothing of it is stored",
                    {"pages_read": str(pages), "provider_request_id": sent.provider_request_id or ""},
                )
            tokens.add(token)
            next_token = token
        assert last is not None
        document = {"ResultSetMetadata": metadata, "Rows": rows}
        return Response(
            http_status=200,
            headers={"content-type": "application/json", "x-jobtrail-pages": str(pages)},
            provider_request_id=last.provider_request_id,
            raw=compact_json(document).encode("utf-8"),
        )


# -- building from a provider file ------------------------------------------------------------------


def _credential_refused(raw: bytes | Spooled) -> bool:
    if isinstance(raw, Spooled):  # a credential error is a small body; a large one is something else
        return False
    try:
        body = parse_answer(raw) if raw.strip() else None
    except ValueError:
        return False
    kind = body.get("__type") if isinstance(body, dict) else None
    return isinstance(kind, str) and kind.rsplit("#", 1)[-1] in _CREDENTIAL_ERRORS


def _word(value: Any, redactor: Redactor) -> str | None:
    """A state as AWS spells it (a string), or None: one that echoes the credential is not stored."""
    return value if isinstance(value, str) and unusable(value, redactor) is None else None


def _stamp(*values: Any) -> str | None:
    """The first timestamp AWS's JSON protocol sends (epoch seconds, a number), as text; anything else
    (a string, an object: a lying answer's, which could carry the credential) is not a time."""
    for value in values:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return str(value)
    return None


def _about_time(message: str) -> bool:
    text = message.lower()
    return any(words in text for words in ("signature expired", "not yet current", "skew", "expired", "in the future"))


def _clock_offset(answer: WireAnswer | NoAnswer) -> float | None:
    """Seconds AWS's clock is ahead of ours (by its Date header) when ``answer`` refused a request for the time
    it was signed at; else None."""
    if not isinstance(answer, WireAnswer) or answer.status not in (400, 401, 403) or isinstance(answer.body, Spooled):
        return None
    try:
        body = parse_answer(answer.body) if answer.body.strip() else None
    except ValueError:
        return None
    raw = body.get("__type") if isinstance(body, dict) else None
    kind = raw.rsplit("#", 1)[-1].split(":", 1)[0] if isinstance(raw, str) else None
    message = (body.get("message") or body.get("Message") or "") if isinstance(body, dict) else ""
    if kind not in _CLOCK_ERRORS or not isinstance(message, str) or not _about_time(message):
        return None
    date = next((v for k, v in answer.headers.items() if k.lower() == "date"), None)
    try:
        theirs = email.utils.parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None
    return None if theirs is None else theirs - time.time()


def _add_auth_at(signer: Any, request: Any, offset_s: float) -> None:
    """SigV4Auth.add_auth with the time shifted by ``offset_s`` (AWS's clock, not ours)."""
    import datetime

    from botocore.auth import SIGV4_TIMESTAMP

    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    request.context["timestamp"] = at.strftime(SIGV4_TIMESTAMP)
    signer._modify_request_before_signing(request)
    signature = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    signer._inject_signature_to_request(request, signature)


def _trimmed(body: Mapping[str, Any]) -> dict[str, Any]:
    """A DescribeExecution answer without the input and output texts (the request and the result are
    stored once each, not in every observation)."""
    return {k: v for k, v in body.items() if k not in ("input", "output")}


def _same_json(theirs: Any, ours: str) -> bool:
    if not isinstance(theirs, str):
        return False
    if theirs == ours:
        return True
    try:
        return bool(parse_json(theirs) == parse_json(ours))
    except ValueError:
        return False


_COMMON_ALSO = ("region", "aws_profile", "result")


def partition_of(region: str, source: str) -> tuple[str, str]:
    """The partition ``region`` belongs to and its DNS suffix, as botocore's endpoint rules decide them.

    Endpoints differ by partition (``states.cn-north-1.amazonaws.com.cn``, ``states.us-iso-east-1.c2s.ic.gov``),
    so ``amazonaws.com`` is right only for some. botocore's partition data (the same file its endpoint
    resolver reads, updated with botocore) is matched the way that resolver matches it: a region it lists,
    or one its pattern admits; anything else is the first partition, ``aws``, as in botocore.
    """
    from botocore.exceptions import DataNotFoundError
    from botocore.loaders import create_loader  # type: ignore[import-untyped]

    try:
        partitions = create_loader().load_data("partitions")["partitions"]
    except (DataNotFoundError, KeyError, TypeError):
        raise ConfigError(
            f"{source}: region {region}: this botocore has no partition data to find its endpoint; set base_url, "
            "or upgrade botocore"
        ) from None
    for partition in partitions:
        if region in partition["regions"] or re.match(partition["regionRegex"], region):
            return str(partition["id"]), str(partition["outputs"]["dnsSuffix"])
    return str(partitions[0]["id"]), str(partitions[0]["outputs"]["dnsSuffix"])


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:  # noqa: PLR0912 - each operator key, checked
    """Build the adapter a ``kind = "aws-stepfunctions"`` or ``"aws-athena"`` file declares."""
    if kind not in ("aws-stepfunctions", "aws-athena"):
        raise ConfigError(f"{source}: kind {kind!r} is not an AWS adapter")
    try:
        import botocore  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{source}: kind = {kind!r} signs requests with botocore: pip install 'jobtrail[aws]'"
        ) from None
    sfn = kind == "aws-stepfunctions"
    also = (*_COMMON_ALSO, "state_machine_arn") if sfn else (*_COMMON_ALSO, "work_group", "output_location")
    settings = operator_settings(kind, data, source, also=also)
    if "credential" in settings:
        raise ConfigError(
            f"{source}: credential: AWS requests are signed with botocore's credentials; set aws_profile = "
            '"<profile>" or leave it out for botocore\'s default chain (environment, shared files, SSO, roles)'
        )
    if "webhooks" in settings:
        raise ConfigError(f"{source}: webhooks: {kind} sends no webhooks to jobtrail; remove [webhooks]")
    result_s = settings.pop("result", None) or {}
    if not isinstance(result_s, Mapping) or set(result_s) - {"max_bytes", "schema", "min_records", "check"}:
        raise ConfigError(f"{source}: [result] may set only max_bytes, schema, min_records, check (the rest is fixed)")
    profile = settings.pop("aws_profile", None)
    if profile is not None and (not isinstance(profile, str) or not profile):
        raise ConfigError(f"{source}: aws_profile: expected a profile name, got {profile!r}")
    arn = settings.pop("state_machine_arn", None) if sfn else None
    match = None
    if sfn:
        match = _SM_ARN.match(arn) if isinstance(arn, str) else None
        if match is None:
            raise ConfigError(
                f"{source}: state_machine_arn: expected arn:aws:states:<region>:<account>:stateMachine:<name>, "
                f"got {arn!r}"
            )
    region = settings.pop("region", None) or (match["region"] if match else None)
    if not isinstance(region, str) or not _REGION.match(region):
        raise ConfigError(f"{source}: region: expected an AWS region such as us-east-1, got {region!r}")
    partition, dns_suffix = partition_of(region, source)
    if match is not None and match["partition"] != partition:
        # the request would be signed for one partition and sent to another's endpoint: refused by AWS
        raise ConfigError(
            f"{source}: state_machine_arn is in partition {match['partition']!r} but region {region} is in "
            f"{partition!r}; the region (or the ARN) is wrong"
        )
    work_group = settings.pop("work_group", None)
    output_location = settings.pop("output_location", None)
    for key, value in (("work_group", work_group), ("output_location", output_location)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{source}: {key}: expected a non-empty string, got {value!r}")
    if output_location is not None and not output_location.startswith("s3://"):
        raise ConfigError(f"{source}: output_location: expected s3://bucket/prefix/, got {output_location!r}")
    host = "states" if sfn else "athena"
    settings.setdefault("base_url", f"https://{host}.{region}.{dns_suffix}")
    settings.setdefault("name", kind)
    settings.setdefault("target", arn if sfn else f"athena:{region}:{work_group or 'primary'}")
    parts = urllib.parse.urlsplit(str(settings["base_url"]))
    if parts.scheme != "https" and not is_loopback(parts.hostname or ""):
        raise ConfigError(
            f"{source}: base_url: expected https:// (signed AWS requests go over plain HTTP only to loopback), "
            f"got {settings['base_url']!r}"
        )
    if parts.path not in ("", "/"):
        raise ConfigError(f"{source}: base_url: expected an origin without a path, got {settings['base_url']!r}")
    if sfn:
        contract: dict[str, Any] = {
            "create": {
                "method": "POST",
                "path": "/",
                "token": {"in": "body", "name": "name"},
                "token_retention_s": SFN_NAME_RETENTION_S,
                "job_id": "$.executionArn",
            },
            "status": {"method": "POST", "path": "/", "state": "$.status"},
            "states": {
                "queued": [],
                "running": ["RUNNING", "PENDING_REDRIVE"],
                "succeeded": ["SUCCEEDED"],
                "failed": ["FAILED", "TIMED_OUT"],
                "cancelling": [],
                "cancelled": ["ABORTED"],
                "expired": [],
            },
            "cancel": {"method": "POST", "path": "/", "idempotent": False},
            "result": {"kind": "safe_read", "content_type": "application/json", **result_s},
        }
    else:
        contract = {
            "create": {
                "method": "POST",
                "path": "/",
                "token": {"in": "body", "name": "ClientRequestToken"},
                "job_id": "$.QueryExecutionId",
            },
            "status": {"method": "POST", "path": "/", "state": "$.QueryExecution.Status.State"},
            "states": {
                "queued": ["QUEUED"],
                "running": ["RUNNING"],
                "succeeded": ["SUCCEEDED"],
                "failed": ["FAILED"],
                "cancelling": [],
                "cancelled": ["CANCELLED"],
                "expired": [],
            },
            "cancel": {"method": "POST", "path": "/", "idempotent": False},
            "result": {"kind": "safe_read", "content_type": "application/json", **result_s},
        }
    config = parse_config(settings | contract | {"reconcile": {"modes": ["replay"]}}, source)
    described = f"aws-sigv4:{'profile ' + profile if profile else 'default chain'}"
    config = dataclasses.replace(config, credential=Credential(described, "aws-sigv4"))
    if sfn:
        assert isinstance(arn, str)
        return StepFunctionsProvider(config, region=region, profile=profile, partition=partition)
    return AthenaProvider(
        config, region=region, profile=profile, work_group=work_group, output_location=output_location
    )


__all__ = ["AthenaProvider", "AwsJsonProvider", "StepFunctionsProvider", "aws_error", "build"]
