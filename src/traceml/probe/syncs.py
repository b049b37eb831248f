"""Host-sync sampling (CUDA): which lines of the user's code make the host wait for the GPU.

A host sync (`loss.item()`, `.cpu()`, `print(tensor)`, `if tensor:`, torch.cuda.synchronize)
makes the host wait until the GPU has run everything queued before it, so the host cannot run
ahead: the next batch's loading, the logging, the next launches wait for the GPU instead of
overlapping with it. On a few sampled steps (SAMPLE_STEPS, at the steps in SAMPLE_STARTS and
then every SAMPLE_EVERY_STEPS), the Tensor methods that copy a device value to the host are
wrapped: each call on a device tensor is timed and filed under the first line of code outside
torch and TraceML that made it. The wrappers exist only during a sample; the steps in between
run torch as it is, so a loop without syncs pays nothing. Each sample goes to the collector as
one HostSyncSample, for HOST_SYNC.
"""
from __future__ import annotations

import linecache
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, ParamSpec, Tuple, TypeVar

from traceml.probe.patches.dynamo import run_eagerly_under_dynamo
from traceml.probe.patches.patch import Patch
from traceml.records import HostSyncSample, SyncSite

if TYPE_CHECKING:
    from types import FrameType

    from torch import Tensor

log = logging.getLogger("traceml")
P = ParamSpec("P")  # torch.cuda.synchronize's parameters ...
R = TypeVar("R")  # ... and what it returns, passed through
_now_ns = time.perf_counter_ns

SAMPLE_STEPS = 10
SAMPLE_STARTS = (5, 100)  # after warm-up, and again once the loop has settled
SAMPLE_EVERY_STEPS = 1000  # then one sample every this many steps
# The Tensor methods that read a device value on the host. `to` and `cpu` synchronize only when
# the result is on the host; __format__ and __repr__ are f"{loss:.3f}" and print(loss).
TENSOR_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__format__", "__repr__",
                "nonzero", "cpu", "to")
_COPIES = ("cpu", "to")


class HostSyncSampler:
    """Samples the host syncs of a few steps at a time; the probe calls begin_step at each step
    it returns (sync_due_step) and finish at the end of the run."""

    def __init__(self, rank: int, push: Callable[[HostSyncSample], None],
                 on_device: Optional[Callable[[Tensor], bool]] = None,
                 is_compiling: Optional[Callable[[], bool]] = None):
        import torch

        self.rank = rank
        self._push = push
        # Whether a tensor lives on the device (the host waits to read it): tensor.is_cuda.
        self._on_device = on_device or (lambda tensor: tensor.is_cuda)
        self._compiler = is_compiling  # a function, True while dynamo traces (patches.dynamo.compiling)
        # Frames in these files are not the user's: the site is the first frame outside them.
        self._not_user_code = tuple(os.path.dirname(module.__file__) + os.sep  # type: ignore[type-var, operator]  # packages with a __file__
                                    for module in (torch, sys.modules["traceml"]))
        self.first_sample_step = next_sample_start(-1)
        self._first_step: Optional[int] = None  # the sample in flight
        self._counts: Dict[Tuple[str, int, str], List[int]] = {}  # (file, line, call) -> [calls, wait ns]
        self._reading = False  # inside a timed read: the reads it makes itself are its own
        self._wrappers = Patch()  # the Tensor reads and synchronize, timed during a sample

    # -- called by the probe at a step's start --------------------------------------------
    def begin_step(self, step_index: int) -> float:
        """Start or end a sample at the start of step step_index; returns the next step whose
        start needs this call."""
        try:
            if self._first_step is None:
                self._first_step = step_index
                self._install()
                return step_index + SAMPLE_STEPS
            self._end_sample(step_index)
        except Exception:  # the training comes first: sampling stops, the steps go on
            log.warning("traceml: host-sync sampling stopped after an internal error", exc_info=True)
            self.finish(step_index)
            return float("inf")
        return next_sample_start(step_index)

    def finish(self, step_index: int) -> int:
        """The run ends (or TraceML is taken out) at step step_index: end the sample in flight.
        Returns the step at which sampling resumes, should the steps go on (re-attached)."""
        try:
            self._end_sample(step_index)
        except Exception:
            log.debug("traceml: the last host-sync sample is lost", exc_info=True)
        finally:
            self._wrappers.remove()
        return next_sample_start(step_index)

    def _end_sample(self, step_index: int) -> None:
        self._wrappers.remove()
        first, self._first_step = self._first_step, None
        counts, self._counts = self._counts, {}
        if first is None or step_index <= first:
            return
        sites = [SyncSite(site=_site_name(filename, line), code=linecache.getline(filename, line).strip(),
                          call=call, calls=calls, wait_ms=wait_ns / 1e6)
                 for (filename, line, call), (calls, wait_ns) in counts.items()]
        sites.sort(key=lambda site: -site.wait_ms)
        self._push(HostSyncSample(rank=self.rank, first_step=first, steps=step_index - first, sites=sites))

    # -- the wrappers, installed only during a sample --------------------------------------
    def _install(self) -> None:
        import torch

        for name in TENSOR_READS:
            self._wrappers.replace(torch.Tensor, name, self._timed_read(getattr(torch.Tensor, name), name))
        self._wrappers.replace(torch.cuda, "synchronize", self._timed_synchronize(torch.cuda.synchronize))

    def _timed_read(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        sampler, on_device, compiler = self, self._on_device, self._compiler
        call, copies = "Tensor." + name, name in _COPIES

        def timed(tensor: Tensor, *args: object, **kwargs: object) -> Any:
            if (sampler._reading or (compiler is not None and compiler())
                    or not on_device(tensor)):
                return original(tensor, *args, **kwargs)
            sampler._reading = True
            start_ns = _now_ns()
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                sampler._reading = False
            if not copies or not on_device(result):  # a copy that stays on the device waits for nothing
                sampler._note(call, _now_ns() - start_ns, sys._getframe(1))
            return result

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        timed.__name__, timed.__doc__ = name, original.__doc__
        run_eagerly_under_dynamo(timed, callees_too=True)
        return timed

    def _timed_synchronize(self, original: Callable[P, R]) -> Callable[P, R]:
        sampler = self

        def synchronize(*args: P.args, **kwargs: P.kwargs) -> R:
            start_ns = _now_ns()
            try:
                return original(*args, **kwargs)
            finally:
                sampler._note("torch.cuda.synchronize", _now_ns() - start_ns, sys._getframe(1))

        synchronize.__wrapped__ = original  # type: ignore[attr-defined]
        synchronize.__doc__ = original.__doc__
        run_eagerly_under_dynamo(synchronize, callees_too=True)
        return synchronize

    def _note(self, call: str, wait_ns: int, frame: Optional[FrameType]) -> None:
        try:
            not_user_code = self._not_user_code
            while frame is not None and frame.f_code.co_filename.startswith(not_user_code):
                frame = frame.f_back  # a read inside torch (GradScaler's found_inf.item()) is the caller's
            if frame is None:
                return
            counted = self._counts.setdefault((frame.f_code.co_filename, frame.f_lineno, call), [0, 0])
            counted[0] += 1
            counted[1] += wait_ns
        except Exception:  # never the user's problem
            log.debug("traceml: a host sync was not counted", exc_info=True)


def next_sample_start(step_index: int) -> int:
    """The first sample start after step_index."""
    for start in SAMPLE_STARTS:
        if start > step_index:
            return start
    return (step_index // SAMPLE_EVERY_STEPS + 1) * SAMPLE_EVERY_STEPS


def _site_name(filename: str, line: int) -> str:
    """"train.py:57": the file relative to the working directory when it is under it, else
    its last two path parts (transformers/trainer.py)."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive
        relative = filename
    if relative.startswith(".."):
        relative = os.path.join(*filename.split(os.sep)[-2:]) if os.sep in filename else filename
    return f"{relative}:{line}"
