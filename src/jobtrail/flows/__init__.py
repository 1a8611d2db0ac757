"""Flows: create, observe and collect, cancel, escalation; built on the domain, the ledger's interface and
the provider contract.

Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API.
"""
