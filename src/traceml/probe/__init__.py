"""Inside training: the step probe, its phase patches, device clocks, memory and the sender."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Union

if TYPE_CHECKING:
    from traceml.records import StepRecord

# How a rank sums up its own steps (traceml.summary()'s figures) when it keeps its own summary
# because the collector was lost. The analysis that does it sits above the probe, so the
# package above both (traceml/__init__.py) hands it in.
summarize_steps: Optional[Callable[[List[StepRecord]], Dict[str, Union[int, float, str, None]]]] = None
