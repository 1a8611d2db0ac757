"""The command line's global options, known before anything heavy is imported.

The console entry reads them to find the subcommand (to handle signals early for a worker),
and the root group moves them before the subcommand when they were written after it.
"""

from __future__ import annotations

#: the root's options, and whether each takes a value
GLOBAL_OPTIONS = {"--db": True, "--debug": False}


def hoist_global_options(args: list[str]) -> list[str]:
    """``jobtrail demo --db X`` as ``jobtrail --db X demo``: a global option given after the command
    (people write it there) moves before it; ``--`` ends the search."""
    front: list[str] = []
    rest: list[str] = []
    i, seen_command = 0, False
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        name = arg.split("=", 1)[0]
        if name in GLOBAL_OPTIONS:
            takes_value = GLOBAL_OPTIONS[name] and "=" not in arg
            moved = args[i : i + 2] if takes_value else [arg]
            (front if seen_command else rest).extend(moved)
            i += len(moved)
            continue
        seen_command = seen_command or not arg.startswith("-")
        rest.append(arg)
        i += 1
    return front + rest


def subcommand(args: list[str]) -> str | None:
    """The subcommand: the first word that is neither an option nor a global option's value."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif GLOBAL_OPTIONS.get(arg):
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None
