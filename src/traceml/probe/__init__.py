"""Inside training: the step probe, its phase patches, device clocks, memory and the sender."""
from typing import Any, Callable, Dict, List, Optional

# How a rank sums up its own steps (traceml.summary()'s figures) when it keeps its own summary
# because the collector was lost. The analysis that does it sits above the probe, so the
# package above both (traceml/__init__.py) hands it in.
summarize_steps: Optional[Callable[[List[Any]], Dict[str, Any]]] = None
