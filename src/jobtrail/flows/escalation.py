"""The escalation bundle: everything a person needs to chase a job jobtrail could not settle."""

from __future__ import annotations

import json
from typing import Any

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.explain import next_action
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


def bundle_markdown(bundle: dict[str, Any]) -> str:
    lines = [
        f"# Escalation: {bundle['operation_id']}",
        "",
        f"- provider: {bundle['provider']} (target {bundle['target']})",
        f"- remote job id: {bundle['remote_job_id'] or 'unknown'}",
        f"- trace id: {bundle['trace_id']}",
        f"- state: **{bundle['state']}**: {bundle['reason'] or ''}",
        f"- next action: {bundle['next_action']}",
        f"- last remote state: {bundle['last_remote_state'] or 'unknown'}",
        f"- partial effects (damage bound): {json.dumps(bundle['partial_effects'])}",
        f"- provider request ids: {', '.join(bundle['provider_request_ids']) or 'none'}",
        "",
        "## Cancel attempts and answers",
        "",
    ]
    lines += [
        f"- {c['at']} {c['what']} by {c['actor']}"
        + (f": HTTP {c.get('http_status')}" if c["what"] == "cancel_response" else "")
        for c in bundle["cancel_attempts"]
    ] or ["- none"]
    lines += ["", "## Requests", "", "| at | kind | HTTP | remote state | request id |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['at']} | {r['kind']} | {r['http_status']} | {r['raw_state'] or r['remote_state'] or ''} | "
        f"{r['provider_request_id'] or ''} |"
        for r in bundle["requests"]
    ]
    lines += ["", "## History", "", "| seq | at | actor | from | to | cause |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {h['seq']} | {h['at']} | {h['actor']} | {h['from'] or ''} | {h['to']} | {h['cause']} |"
        for h in bundle["history"]
    ]
    return "\n".join(lines) + "\n"
