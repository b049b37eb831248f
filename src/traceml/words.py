"""How counts read in the findings and on the cards: "1 step", "once", "every step", never
"1 steps", "1 times" or "every 1 steps". Every noun they count takes an s."""
from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """"1 step", "3 steps"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def times(count: int) -> str:
    """"once", "twice", "5 times"."""
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def every(count: int, noun: str) -> str:
    """"every step", "every 10 steps"."""
    return f"every {noun}" if count == 1 else f"every {count} {noun}s"
