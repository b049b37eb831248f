"""How counts and sizes read in the findings and on the cards: "1 step", "once", "every step",
never "1 steps", "1 times" or "every 1 steps" (every noun they count takes an s); "848 B",
"1.5 MiB", "2.00 GiB"."""
from __future__ import annotations

import math
from typing import List, Sequence


def counted(count: int, noun: str) -> str:
    """"1 step", "3 steps"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def times(count: int) -> str:
    """"once", "twice", "5 times"."""
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def every(count: int, noun: str) -> str:
    """"every step", "every 10 steps"."""
    return f"every {noun}" if count == 1 else f"every {count} {noun}s"


def size(count_bytes: float) -> str:
    """"848 B", "3.0 KiB", "1.5 MiB", "2.00 GiB": binary units, the unit the figure needs."""
    value = float(count_bytes)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    if abs(value) < 1024 ** 2:
        return f"{value / 1024:.1f} KiB"
    if abs(value) < 1024 ** 3:
        return f"{value / 1024 ** 2:.1f} MiB"
    return f"{value / 1024 ** 3:.2f} GiB"


def duration(ms: float) -> str:
    """"948 ms" under a second, "29.4 s" from one: a total's figure in a finding."""
    return f"{ms:.0f} ms" if abs(ms) < 999.5 else f"{ms / 1e3:.1f} s"


def rounded_parts(values: Sequence[float], digits: int) -> List[float]:
    """The values rounded to `digits` so that they add up to their sum rounded alike (the largest
    remainders rounded up): a sentence's parts then add up to the total it shows."""
    unit = 10.0 ** -digits
    floors = [math.floor(value / unit + 1e-9) for value in values]
    up = sorted(range(len(values)), key=lambda i: floors[i] - values[i] / unit)[:round(sum(values) / unit) - sum(floors)]
    return [round((floors[i] + (i in up)) * unit, digits) for i in range(len(values))]
