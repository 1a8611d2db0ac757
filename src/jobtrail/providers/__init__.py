"""Providers: the contract every adapter meets, credentials and configuration, the HTTP adapter and
its egress policy, webhook verification. Never touches the ledger.

Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API.
"""
