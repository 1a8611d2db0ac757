"""The ledger: the store and its write path, schema and migrations, the hash chain and audit, stored
results, webhook events and task steps. The only package that speaks SQL.

Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API.
"""
