"""The escalation bundle: everything a person needs to chase a job jobtrail could not settle."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.explain import next_action
from jobtrail.domain.record import Operation
from jobtrail.domain.states import State
from jobtrail.ledger.store import Store


def escalation_bundle(store: Store, operation_id: str) -> dict[str, Any]:
    """Remote job id, trace id, the request history with times, every provider request id,
    the cancel attempts and their answers, and the partial effects reported so far."""
    op = store.resolve(operation_id)  # an id, or the operation's key
    operation_id = op.operation_id
    history = [entry.to_json() for entry in store.history(operation_id)]
    observations = store.observations(operation_id)
    request_ids: list[str] = []
    for entry in history:
        request_ids += [r for r in entry["provider_request_ids"] if r not in request_ids]
    for obs in observations:
        rid = obs["provider_request_id"]
        if rid and rid not in request_ids:
            request_ids.append(rid)
    cancels = [
        {"at": e["at"], "actor": e["actor"], "what": e["cause"], "evidence": e["evidence"]}
        for e in history
        if e["cause"] in ("cancel_intent", "cancel_attempt", "cancel_acknowledged")
    ] + [
        {
            "at": rfc3339(o["fetched_at_us"]),
            "actor": o["worker"],
            "what": "cancel_response",
            "http_status": o["http_status"],
            "provider_request_id": o["provider_request_id"],
            "answer": o["raw"],
        }
        for o in observations
        if o["kind"] == "cancel_response"
    ]
    cancels.sort(key=lambda c: c["at"] or "")
    requests = [
        {
            "at": rfc3339(o["fetched_at_us"]),
            "kind": o["kind"],
            "http_status": o["http_status"],
            "remote_state": o["remote_state"],
            "raw_state": o["raw_state"],
            "provider_request_id": o["provider_request_id"],
            "worker": o["worker"],
        }
        for o in observations
    ]
    return {
        "operation_id": op.operation_id,
        "decision": _decision(op, history, store.command),
        "provider": op.provider,
        "target": op.target,
        "remote_job_id": op.remote_job_id,
        "trace_id": op.trace_id,
        "state": op.state.value,
        "reason": op.state_reason,
        "next_action": next_action(op),
        "last_remote_state": op.remote_state,
        "deadlines": {
            "create": rfc3339(op.create_deadline_us),
            "result": rfc3339(op.result_deadline_us),
            "cancel": rfc3339(op.cancel_deadline_us),
        },
        "partial_effects": op.partial_effects,
        "provider_request_ids": request_ids,
        "cancel_attempts": cancels,
        "requests": requests,
        "history": [
            {"seq": e["seq"], "at": e["at"], "actor": e["actor"], "from": e["from"], "to": e["to"], "cause": e["cause"]}
            for e in history
        ],
    }


def _decision(op: Operation, history: list[dict[str, Any]], jobtrail: str) -> dict[str, Any]:
    """The question a person faces, and for each answer the exact command that records it (``jobtrail``:
    how a command reaches this ledger, its ``--db`` included)."""
    ref = op.operation_key or op.operation_id
    quoted = shlex.quote(ref)
    resolve = f"{jobtrail} resolve {quoted} --by YOUR_NAME --reason"
    if op.state is State.NEEDS_ATTENTION:
        said: dict[str, Any] = next(
            (e["evidence"] for e in reversed(history) if e["to"] == State.NEEDS_ATTENTION.value), {}
        )
        candidates = [str(c) for c in said.get("candidates", [])]
        # a conflict: the same token answered with two job ids (the recorded one first, if one is)
        answered = [
            job
            for job in dict.fromkeys((op.remote_job_id, said.get("first_job_id"), said.get("second_job_id")))
            if isinstance(job, str) and job
        ]
        if op.remote_job_id is None and len(answered) < 2:
            found = candidates or ["JOB_ID"]
            return {
                "question": f"Did provider {op.provider} make a job for this operation? Look for trace id "
                f"{op.trace_id}" + (f" among {', '.join(candidates)}" if candidates else "") + " in its console.",
                "options": [
                    *(
                        {
                            "if": f"job {job} is this operation's",
                            "then": f"{resolve} '...' --to accepted --job-id {shlex.quote(job)}",
                        }
                        for job in found
                    ),
                    {
                        "if": "no job exists",
                        "then": f"{resolve} '...' --to create_pending",
                        "note": "the create is sent again (with the same token, where the provider takes one)",
                    },
                    {"if": "it should not run after all", "then": f"{resolve} '...' --to failed"},
                ],
            }
        named = " and ".join(answered) if len(answered) > 1 else f"{answered[0]} and another (see the history)"
        return {
            "question": f"Which job is this operation's? The provider answered with {named}; keep one and "
            f"cancel the other in provider {op.provider}'s console.",
            "options": [
                *(
                    {
                        "if": f"{job} is the one to keep (once the other is cancelled at the provider)",
                        "then": f"{resolve} '...' --to accepted --job-id {shlex.quote(job)}",
                    }
                    for job in answered
                ),
                {"if": "both were stopped at the provider", "then": f"{resolve} '...' --to cancelled"},
                {"if": "it should not run after all", "then": f"{resolve} '...' --to failed"},
            ],
        }
    if op.state is State.CANCELLATION_UNCONFIRMED:
        return {
            "question": f"Is job {op.remote_job_id} stopped? The cancel was sent; the provider has not confirmed it.",
            "options": [
                {"if": "it still runs and must stop", "then": f"stop it in provider {op.provider}'s console"},
                {"if": "it may finish", "then": "nothing: a worker keeps polling slowly and records how it ends"},
            ],
        }
    if op.state is State.RESULT_TIMED_OUT:
        return {
            "question": f"Job {op.remote_job_id} ran past its result deadline: wait longer, or stop it?",
            "options": [
                # (no cancel is sent past the result deadline: the state machine has no cancel from here)
                {"if": "stop it", "then": f"stop it in provider {op.provider}'s console"},
                {"if": "wait longer", "then": "nothing: a worker keeps polling slowly and records how it ends"},
            ],
        }
    return {"question": "none: " + next_action(op), "options": []}


def bundle_markdown(bundle: dict[str, Any]) -> str:
    """The bundle as Markdown, for a ticket. What came from outside (a provider's words, ids and states; a
    person's names and reasons) is shown as text, never read as Markdown or HTML: no image, link, emphasis,
    HTML or table cell is made of it, and a command to copy is in a code span nothing in it can end."""
    lines = [
        f"# Escalation: {bundle['operation_id']}",
        "",
        f"- provider: {_md(bundle['provider'])} (target {_md(bundle['target'])})",
        f"- remote job id: {_md(bundle['remote_job_id'] or 'unknown')}",
        f"- trace id: {bundle['trace_id']}",
        f"- state: **{bundle['state']}**: {_md(bundle['reason'] or '')}",
        f"- next action: {_md(bundle['next_action'])}",
        f"- last remote state: {_md(bundle['last_remote_state'] or 'unknown')}",
        f"- partial effects (damage bound): {_md(json.dumps(bundle['partial_effects']))}",
        f"- provider request ids: {', '.join(_md(i) for i in bundle['provider_request_ids']) or 'none'}",
        "",
        "## The decision",
        "",
        _md(bundle["decision"]["question"]),
        "",
    ]
    lines += [
        f"- if {_md(o['if'])}: {_code(o['then'])}" + (f" ({_md(o['note'])})" if o.get("note") else "")
        for o in bundle["decision"]["options"]
    ]
    lines += ["", "## Cancel attempts and answers", ""]
    lines += [
        f"- {c['at']} {c['what']} by {_md(c['actor'])}"
        + (f": HTTP {c.get('http_status') or '-'}" if c["what"] == "cancel_response" else "")
        + _intent(c)
        for c in bundle["cancel_attempts"]
    ] or ["- none"]
    lines += ["", "## Requests", "", "| at | kind | HTTP | remote state | request id |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['at']} | {r['kind']} | {r['http_status'] or '-'} | {_md(r['raw_state'] or r['remote_state'] or '')} | "
        f"{_md(r['provider_request_id'] or '')} |"
        for r in bundle["requests"]
    ]
    lines += ["", "## History", "", "| seq | at | actor | from | to | cause |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {h['seq']} | {h['at']} | {_md(h['actor'])} | {h['from'] or ''} | {h['to']} | {h['cause']} |"
        for h in bundle["history"]
    ]
    return "\n".join(lines) + "\n"


#: what Markdown (CommonMark and GitHub's) reads inside a line: code spans, emphasis, links and images, HTML,
#: entities, table cells, strikethrough, GitHub's math (``$``), and the starts of autolinks (``https://``,
#: ``www.`` in any case, an address's @); an underscore between two letters or digits (``job_00001``) never
#: makes emphasis, and is left as it is
_MARKDOWN = re.compile(r"[\\`*\[\]<>!|~&@$]|(?<![^\W_])_|_(?![^\W_])|(?<=(?i:www))\.|:(?=//)")


def _md(text: object) -> str:
    """``text`` shown as it is in Markdown: each character Markdown would read backslash-escaped (any ASCII
    punctuation may be), and a line break as a space (no text from outside starts a line of its own)."""
    return _MARKDOWN.sub(lambda m: "\\" + m.group(0), " ".join(str(text).splitlines()))


def _code(command: str) -> str:
    """``command`` in a code span that nothing in it can end: on one line, a fence of one backtick more than
    the longest run in it, and a space inside each end (CommonMark takes one off each)."""
    command = " ".join(command.splitlines())  # (a line break would end the list item, and the span with it)
    fence = "`" * (max((len(run) for run in re.findall("`+", command)), default=0) + 1)
    return f"{fence} {command} {fence}"


def _intent(attempt: dict[str, Any]) -> str:
    """Why the cancel was asked for, and what its asker expected (the ``--expect``)."""
    if attempt["what"] != "cancel_intent":
        return ""
    said = attempt.get("evidence") or {}
    expect = f" (expecting: {_md(said['expected_effect'])})" if said.get("expected_effect") else ""
    return f": {_md(said.get('reason', ''))}{expect}"
