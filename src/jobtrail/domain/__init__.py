"""The domain: states, evidence, the state machine, the operation record, next actions, canonical
JSON, ids, back-off, errors, redaction, JSON paths, result checks. It imports nothing else of jobtrail.

Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API.
"""
