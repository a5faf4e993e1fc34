"""A refused constraint (`GrammarRefused`, with its HTTP status) and the check every compiled text
shares: repetition counts the compiler can hold. Apart from limits.py so schema.py can use them."""
from __future__ import annotations

import re

MAX_REPETITION = 2**31 - 1         # xgrammar keeps counts in 32 bits: a larger one wraps around
_REPETITION = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")      # {n}, {n,}, {n,m}


class GrammarRefused(ValueError):
    """A constraint the server will not compile: `status` 400 (bad or too large), 408 (over its time
    budget) or 503 (the compiler is unavailable); the message names the limit and its flag."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_repetitions(name: str, text: str) -> None:
    """A repetition count past 32 bits would wrap around in the compiler (to a wrong or negative count)."""
    for match in _REPETITION.finditer(text):
        count = max(int(n) for n in match.groups() if n)
        if count > MAX_REPETITION:
            raise GrammarRefused(f"The {name} has a repetition count of {count}, more than the compiler's largest "
                                 f"({MAX_REPETITION}); use a smaller count.")
