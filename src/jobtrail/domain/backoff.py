"""When to try again: ``Retry-After`` when the provider says, else capped exponential back-off."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime

_DELAY_SECONDS = re.compile("[0-9]+")
_CENTURIES = 1e10


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential back-off with full jitter (AWS architecture blog's "full jitter")."""

    initial_s: float = 0.5
    factor: float = 2.0
    cap_s: float = 60.0
    #: the longest Retry-After we honour; a larger one is clamped to this
    max_retry_after_s: float = 3600.0
    #: the random share of each delay: 1.0 is full jitter (0..ceiling), 0.1 waits 90-100 % of it
    jitter: float = 1.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` >= 1)."""
        ceiling = min(self.cap_s, self.initial_s * self.factor ** min(max(attempt - 1, 0), 64))
        return ceiling * (1 - self.jitter * (rng or random).random())

    def after(self, retry_after_s: float | None, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1``: no sooner than the provider's ``Retry-After``
        (capped), nor than this back-off's own delay. A provider that answers every try with
        ``Retry-After: 0`` (or a date gone by) was asked again at once: hundreds of requests a second,
        each written to the ledger, until a deadline."""
        delay = self.delay(attempt, rng)
        if retry_after_s is not None:
            return max(min(retry_after_s, self.max_retry_after_s), delay)
        return delay


def parse_retry_after(value: str | None, now_s: float) -> float | None:
    """Seconds to wait from ``now_s`` per RFC 9110 §10.2.3 (delay-seconds or HTTP-date).

    Past dates become 0; garbage is ignored (None), never an error.
    """
    if value is None:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):  # ASCII digits only: "²".isdigit() holds, and int("²") raises
        # past ten digits (three centuries) the figure is moot, the cap decides; and int() of a few
        # thousand digits raises, a float() of a few hundred overflows
        return float(int(value)) if len(value) <= 10 else _CENTURIES
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # asctime and RFC 850 forms carry no zone; HTTP dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now_s)
