"""Move jobtrail's flat private modules into layer packages, and rewrite every reference.

Idempotent: run it on any checkout (before or after the move) and it does what is
left to do. It is the mechanical half of issue 15's layout; the hand fixes that
make the import contracts pass (splits of results, webhooks and task steps, the
SQL moved into the ledger) are separate commits on top.

    python tools/relayout.py        # from the repository root
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "jobtrail"

#: old private module -> new dotted place under jobtrail
MOVES = {
    # the domain: pure vocabulary and rules, imports nothing else of jobtrail
    "_states": "domain.states",
    "_evidence": "domain.evidence",
    "_machine": "domain.machine",
    "_record": "domain.record",
    "_explain": "domain.explain",
    "_canonical": "domain.canonical",
    "_ids": "domain.ids",
    "_backoff": "domain.backoff",
    "_errors": "domain.errors",
    "_redact": "domain.redact",
    "_jsonpath": "domain.jsonpath",
    "_failpoints": "domain.failpoints",
    # the ledger: the only SQL
    "_store": "ledger.store",
    "_writer": "ledger.writer",
    "_schema": "ledger.schema",
    "_migrate": "ledger.migrate",
    "_chain": "ledger.chain",
    "_audit": "ledger.audit",
    "_results": "ledger.results",
    "_offload": "ledger.offload",
    # providers: the contract and the HTTP adapter with its transport
    "_provider": "providers.contract",
    "_http_provider": "providers.http",
    "_config": "providers.config",
    "_egress": "providers.egress",
    # flows: one operation's steps, on the domain, the ledger and the provider contract
    "_create": "flows.create",
    "_observe": "flows.observe",
    "_cancel": "flows.cancel",
    "_escalation": "flows.escalation",
    # runtime: what runs the flows
    "_client": "runtime.client",
    "_worker": "runtime.worker",
    "_tasks": "runtime.tasks",
    # interfaces: people and other programs
    "_cli": "interfaces.cli",
    "_mcp": "interfaces.mcp",
    "_webhooks": "interfaces.webhooks",
    "_demo": "interfaces.demo",
    "_entry": "interfaces.entry",
}
#: directories that move with their module
DIR_MOVES = {"_migrations": "ledger/migrations"}

PACKAGES = {
    "domain": "The domain: states, evidence, the state machine, the operation record, next actions, canonical\n"
    "JSON, ids, back-off, errors, redaction, JSON paths, result checks. It imports nothing else of jobtrail.",
    "ledger": "The ledger: the store and its write path, schema and migrations, the hash chain and audit, stored\n"
    "results, webhook events and task steps. The only package that speaks SQL.",
    "providers": "Providers: the contract every adapter meets, credentials and configuration, the HTTP adapter and\n"
    "its egress policy, webhook verification. Never touches the ledger.",
    "flows": "Flows: create, observe and collect, cancel, escalation; built on the domain, the ledger's interface and\n"
    "the provider contract.",
    "runtime": "Runtime: the client, the worker and agent tasks, which run the flows.",
    "interfaces": "Interfaces: the command line, the MCP server, the webhook receiver, the demo.",
}
HEADER = "Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API."

TEXT_ROOTS = ["src", "tests", "bench", "examples", "tools"]
TEXT_FILES = ["pyproject.toml", "README.md", ".ci/run", ".importlinter"]


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def move_files() -> None:
    for old, new in MOVES.items():
        src = PKG / f"{old}.py"
        dst = PKG / (new.replace(".", "/") + ".py")
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            git("mv", str(src), str(dst))
    for old, new in DIR_MOVES.items():
        src, dst = PKG / old, PKG / new
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            git("mv", str(src), str(dst))
    for name, doc in PACKAGES.items():
        init = PKG / name / "__init__.py"
        if not init.exists():
            init.write_text(f'"""{doc}\n\n{HEADER}\n"""\n', encoding="utf-8")
            git("add", str(init))


def _new(old: str) -> str:
    return "jobtrail." + MOVES[old]


def rewrite(text: str) -> str:
    # from jobtrail import _a, _b as c   ->   one line per module, names kept
    def from_pkg(m: re.Match[str]) -> str:
        indent, names = m.group(1), m.group(2)
        parts = [p.strip() for p in names.split(",") if p.strip()]
        if not all(p.split()[0] in MOVES for p in parts):
            return m.group(0)
        lines = []
        for p in parts:
            bits = p.split()
            old = bits[0]
            alias = bits[2] if len(bits) == 3 else old
            parent, _, leaf = _new(old).rpartition(".")
            lines.append(f"{indent}from {parent} import {leaf} as {alias}")
        return "\n".join(lines)

    one = r"_[a-z_]+(?: as \w+)?"
    text = re.sub(rf"(?m)^([ \t]*)from jobtrail import ({one}(?:, *{one})*)$", from_pkg, text)

    # every dotted reference: imports, strings, docs, entry points
    def dotted(m: re.Match[str]) -> str:
        old = m.group(1)
        return _new(old) if old in MOVES else m.group(0)

    text = re.sub(r"\bjobtrail\.(_[a-z_]+)\b", dotted, text)
    # paths of the migration scripts (package data; the migrate module's neighbour; mentions in prose)
    text = text.replace('"_migrations/script.py.mako"', '"ledger/migrations/script.py.mako"')
    return re.sub(r"(?<![\w.])_migrations\b", "migrations", text)


def rewrite_tree() -> None:
    files = [ROOT / f for f in TEXT_FILES if (ROOT / f).exists()]
    for root in TEXT_ROOTS:
        if (ROOT / root).exists():
            files += [p for p in (ROOT / root).rglob("*") if p.suffix in (".py", ".toml", ".md", ".mako")]
    for path in files:
        if path.resolve() == Path(__file__).resolve() or ".venv" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            path.write_text(new, encoding="utf-8")


def main() -> int:
    move_files()
    rewrite_tree()
    ruff = ROOT / ".venv" / "bin" / "ruff"
    tool = str(ruff) if ruff.exists() else "ruff"
    subprocess.run([tool, "check", "--fix", "--select", "I", "--quiet", "src", "tests", "bench"], cwd=ROOT, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
