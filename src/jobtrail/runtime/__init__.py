"""Runtime: the client, the worker and agent tasks, which run the flows.

Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API.
"""
