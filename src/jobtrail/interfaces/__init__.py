"""Interfaces: the command line, the MCP server, the webhook receiver, the demo.

Only the names re-exported by :mod:`jobtrail` (and :mod:`jobtrail.testing`) are public API.
"""
