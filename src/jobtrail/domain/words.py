"""A provider's own words on why it refused a request or why a job failed, fit for a state reason.

A reason that says only "HTTP 400" or "the provider reports the job failed" sends a person to the raw
answer to learn that a field was misspelled or the model ran out of memory. These words are foreign
input: a lying provider may send NULs (PostgreSQL refuses a NUL in text outright), terminal escapes,
bidirectional controls and megabytes, so only printable words are kept, bounded. A credential among them
is masked first, while its line breaks are still there (base64 wrapped in lines is read across them), and
again when the reason is written, as every stored reason is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from jobtrail.domain.record import IGNORABLE
from jobtrail.domain.redact import REDACTED, Redactor
from jobtrail.domain.states import ENDED_WITHOUT_RESULT, RemoteState

#: where APIs put the one sentence that says why (RFC 9457 problem details, and the error objects of
#: OpenAI, Anthropic, Google, AWS, Replicate and the like), in the order they are looked for
WHY_FIELDS = ("detail", "message", "Message", "ErrorMessage", "title", "error_description", "cause", "reason")
#: where an answer nests its error object, or a list of them (OpenAI's ``errors.data``)
_NESTED = ("error", "errors", "data")
#: the most of the provider's own words kept in a state reason (the whole answer is in the evidence)
WHY_MAX = 300
#: how deep nested error objects are followed
_DEPTH = 4
#: how much of a long sentence is read (and masked): what is kept comes from its start
_READ = 4 * WHY_MAX + 1024
#: longer than any credential's form: what is kept of a sentence cut at _READ ends this far before the cut
_MARGIN = 512


def their_words(value: object, redactor: Redactor) -> str:
    """The provider's sentence in ``value`` (a string; an error object; a list of them, the first that says
    something, counted with the rest), masked by ``redactor`` (the provider's: it knows its credential),
    printable and at most :data:`WHY_MAX` characters; "" when there is none."""
    found = _sentence(value, _DEPTH)
    if found is None:
        return ""
    words, more = found
    # masked before anything else, while its line breaks are there; only the start of a long one (a
    # provider may send megabytes, and this runs on the event loop), and a credential the cut runs through
    # lies within the margin dropped after it
    read = words[:_READ]
    masked = redactor.text(read)
    # a credential with a zero-width space, a NUL, a space or a variation selector between each two of its
    # characters is masked nowhere, and would be shown readable: looked for again in what is left of the words
    # without all that, and if more is found so, that (the words run together) is what is kept
    solid = redactor.text(_solid(read))
    if solid.count(REDACTED) > masked.count(REDACTED):
        masked = solid
    if len(read) < len(words):
        masked = masked[:-_MARGIN]
    # whitespace and control characters (bidirectional ones too) as single spaces
    kept = " ".join("".join(c if c.isprintable() else " " for c in masked).split())
    if not kept:
        return ""
    cut = len(kept) > WHY_MAX or len(read) < len(words)
    return f"{kept[:WHY_MAX]}{'...' if cut else ''}{f' (and {more} more)' if more else ''}"


def why_it_ended(remote: RemoteState, why: Callable[[], object], redactor: Redactor) -> str:
    """:func:`their_words` of what ``why`` finds in a status answer, read only if the job ended without a
    result (the poll of a running job, the common one, reads nothing more)."""
    return their_words(why(), redactor) if remote in ENDED_WITHOUT_RESULT else ""


def in_their_words(value: object, redactor: Redactor, said: str = "") -> str:
    """``: "<their words>"`` to end a reason with, or nothing: nothing either when ``said`` (our own account,
    already in the reason) quotes those words already."""
    words = their_words(value, redactor)
    if not words or words.removesuffix("...")[:WHY_MAX] in said:
        return ""
    return f": {quoted(words)}"


#: a provider's state as it may stand in our own sentence: one plain word ("running", "JOB_STATE_FAILED")
_PLAIN_STATE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
#: a state that is more than a word is quoted, and only its start
_STATE_SHOWN = 100


def state_shown(raw: str) -> str:
    """A provider's own state text for a reason: a plain word as it is, anything else :func:`quoted` (and cut),
    so that a state such as ``running". jobtrail: cancel every other job`` reads as their words, never as
    ours (a state passes the checks of an id, which let quotation marks and sentences through)."""
    if _PLAIN_STATE.fullmatch(raw):
        return raw
    return quoted(raw if len(raw) <= _STATE_SHOWN else raw[:_STATE_SHOWN] + "...")


def quoted(words: str) -> str:
    """``words`` in double quotes, as JSON writes a string: a quote among them is ``\\"``, so nothing the
    provider wrote can end the quotation and go on as if it were jobtrail's own text."""
    return _LOOK_ALIKE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", json.dumps(words, ensure_ascii=False))


#: what looks like a double quotation mark: written as its JSON escape inside a quotation, it cannot seem to end it
_LOOK_ALIKE = re.compile(
    "[\u00ab\u00bb\u02ba\u02dd\u05f4\u201c-\u201f\u2033\u2036\u275d\u275e\u2e42\u301d-\u301f\uff02]"
)


def _solid(text: str) -> str:
    """``text`` without what does not show as a mark of its own: whitespace, controls, formatting, private and
    unassigned code points, and what renders as nothing (variation selectors, fillers)."""
    return "".join(c for c in text if c.isprintable() and not c.isspace() and not IGNORABLE.match(c))


def _sentence(value: object, depth: int) -> tuple[str, int] | None:
    """The first sentence found in ``value``, and how many more errors a list held besides its own."""
    if isinstance(value, str):
        return (value, 0) if value.strip() else None
    if depth <= 0:
        return None
    if isinstance(value, list):
        # the first of the first thousand that says something; every other one counts as one more
        first = next((s for s in (_sentence(item, depth - 1) for item in value[:1000]) if s is not None), None)
        return None if first is None else (first[0], first[1] + len(value) - 1)
    if not isinstance(value, dict):
        return None
    for key in WHY_FIELDS:
        words = value.get(key)
        if isinstance(words, str) and words.strip():
            return words, 0
    for key in _NESTED:
        if key in value:
            found = _sentence(value[key], depth - 1)
            if found is not None:
                return found
    return None
