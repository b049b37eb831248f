"""Zero-code mode: `traceml run` starts every script through this module, so a script that never
imports traceml is still traced, with steps inferred from `optimizer.step()`.

    python -m traceml.probe.zero_code train.py --its --args

Nothing is made until the script's first module call: the probe must know the model's device
(CUDA events or the host clock) and the script may still call trace_step itself, which then
decides the steps as usual. Until that first call a one-shot process-wide forward pre-hook is
all there is.
"""
from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any, List

log = logging.getLogger("traceml")


def _start_at_first_forward() -> None:
    from torch.nn.modules import module as nn_module

    handles: List[Any] = []

    def first_forward(module: Any, args: Any) -> None:
        for handle in handles:
            handle.remove()
        handles.clear()
        try:
            from traceml.probe import step

            if step._probe is not None:  # trace_step came first: the script traces itself
                return
            device_of = module if next(module.parameters(), None) is not None else None
            probe = step.infer_steps(device_of=device_of)
            if probe is not None and probe.outermost is not None:
                probe.outermost._before(module, args)  # this very call is the first forward
        except Exception:
            log.warning("traceml: could not start tracing; the script runs untraced", exc_info=True)

    handles.append(nn_module.register_module_forward_pre_hook(first_forward))


def main(argv: List[str]) -> None:
    if not argv:
        sys.exit("usage: python -m traceml.probe.zero_code SCRIPT [ARGS ...]")
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would
    try:
        _start_at_first_forward()
    except Exception:  # no torch, or a torch without global hooks: the script runs untraced
        log.warning("traceml: zero-code tracing unavailable", exc_info=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
