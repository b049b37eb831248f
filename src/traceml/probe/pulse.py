"""While a rank ends no step: where its training thread is, read by the sender thread.

The sender thread looks each flush (every 100 ms) at how many steps the probe has ended. Once
none has ended for PULSE_AFTER_S it takes the training thread's stack with
sys._current_frames(), which works while that thread waits in C (a collective, a socket, a
sleep), and sends it as a RankPulse; then again every PULSE_EVERY_S while no step ends. A rank
that steps costs one integer comparison a flush.

What the stack says is read here too, where the frames are: a torch.distributed collective
being waited in, a DataLoader wait, a checkpoint save or a compilation (the hang rule leaves
those alone), and which frames are the user's own. With it go two figures that tell why: the
collectives the rank has issued (each process group's sequence number, the default group's
counting DDP's and FSDP's own as well as the script's), the group the collective it waits in was
issued on, and, in a DataLoader wait, the worker that owes
the batch and its state (probe/loaders.py).
"""
from __future__ import annotations

import collections
import os
import sys
import sysconfig
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Tuple

from traceml.probe.layout import NO_PHASE

if TYPE_CHECKING:
    from traceml.probe.loaders import LoaderWatch
from traceml.records import PULSE_AFTER_S, PULSE_EVERY_S, TIMED_PHASES, Beside, Phase, RankPulse

STACK_FRAMES = 12  # the user's innermost frames kept

# Functions of torch.distributed a rank waits in for the others.
_COLLECTIVE_WAITS = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "wait", "_all_gather_base",
    "_reduce_scatter_base", "all_gather_single", "reduce_scatter_single"))
_LIBRARY_ROOTS = tuple({os.path.normcase(path) for path in (
    *(sysconfig.get_paths().get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) if path})


class PulsedProbe(Protocol):
    """What a pulse reads of the probe (a probe.step.StepProbe): its step count, its open phase,
    whether it is in evaluation."""

    step_index: int  # the steps ended so far
    in_step: int  # trace_step blocks open (nested integrations count each)
    open_phase: int  # the timed phase open, probe.layout's index; NO_PHASE when none
    in_evaluation: bool


class PulseWatch:
    """Sends a RankPulse while the rank's training thread ends no step (see the docstring).
    probe: the StepProbe (its step count, open phase, evaluation flag); thread_id: the
    training thread's ident; evaluating: whether the training thread is in an evaluation region
    the patches found."""

    def __init__(self, rank: int, probe: PulsedProbe, thread_id: int, loaders: Optional[LoaderWatch] = None,
                 clock: Callable[[], float] = time.monotonic, evaluating: Callable[[], bool] = lambda: False):
        self.rank, self.probe, self.thread_id, self._clock = rank, probe, thread_id, clock
        self._evaluating = evaluating
        self.loaders = loaders  # the sender's probe.loaders.LoaderWatch, for the worker a wait is on
        self._steps_seen = -1
        self._progress_at = clock()
        self._pulsed_at: Optional[float] = None

    def due(self) -> Optional[RankPulse]:
        """The pulse to send now, if one is due."""
        now = self._clock()
        steps = int(getattr(self.probe, "step_index", 0))
        if steps != self._steps_seen:
            self._steps_seen, self._progress_at, self._pulsed_at = steps, now, None
            return None
        if now - self._progress_at < PULSE_AFTER_S:
            return None
        if self._pulsed_at is not None and now - self._pulsed_at < PULSE_EVERY_S:
            return None
        self._pulsed_at = now
        return self.pulse(steps, now - self._progress_at)

    def pulse(self, steps: int, since_progress_s: float) -> RankPulse:
        frame = sys._current_frames().get(self.thread_id)
        frames = _frames(frame)
        waiting_in, activity = _read(frames)
        innermost = f"{os.path.basename(frames[0][0])}:{frames[0][1]} {frames[0][2]}" if frames else ""
        # The count is a call into the process group from this thread: made only once a step has
        # ended (the group is set up) and while the training thread is not inside torch.distributed
        # but to wait in a collective (it is not using the group then); -1 otherwise.
        in_distributed = any("/torch/distributed/" in path.replace("\\", "/") for path, _, _ in frames)
        in_collective = waiting_in not in ("", "DataLoader")
        readable = steps and (in_collective or not in_distributed)
        count, subgroups = collectives_issued() if readable else (-1, {})
        waiting_group = _waited_group(frame, waiting_in) if in_collective and readable else ""
        worker = self.loaders.awaited_worker() if waiting_in == "DataLoader" and self.loaders else None
        worker_id, worker_pid, worker_state = worker or (-1, 0, "")
        return RankPulse(rank=self.rank, unix_s=time.time(), steps_ended=steps,
                         since_progress_s=round(since_progress_s, 3), phase=activity or self._phase(),
                         stack=[frame for frame in frames if is_user_frame(frame[0])][:STACK_FRAMES],
                         innermost=innermost, waiting_in=waiting_in, pid=os.getpid(),
                         collectives_issued=count, loader_worker=worker_id,
                         loader_worker_pid=worker_pid, loader_worker_state=worker_state,
                         subgroup_collectives=subgroups, waiting_group=waiting_group)

    def _phase(self) -> str:
        probe = self.probe
        if getattr(probe, "in_evaluation", False) or self._evaluating():
            return Beside.EVALUATION
        if not getattr(probe, "in_step", 0):
            return Phase.OUTSIDE
        open_phase = getattr(probe, "open_phase", NO_PHASE)
        return TIMED_PHASES[open_phase] if 0 <= open_phase < len(TIMED_PHASES) else Beside.IN_STEP


def collectives_issued() -> Tuple[int, Dict[str, int]]:
    """The collectives issued on the default process group so far (-1 when there is none), and
    on each other group this rank belongs to, by its label. Read from each group's sequence
    number, a counter the backend keeps (gloo and NCCL alike)."""
    try:
        world, labels = _groups()
        if world is None:
            return -1, {}
        subgroups = {label: int(group._get_sequence_number_for_group())
                     for group, label in labels.items() if group is not world}
        return int(world._get_sequence_number_for_group()), subgroups
    except Exception:  # a backend without the counter, or a group being torn down
        return -1, {}


def _groups() -> Tuple[Any, Dict[Any, str]]:
    """(the default group or None, {each group this rank belongs to: its label}). A label
    names the group's ranks, so every member gives it the same one; two groups of the same
    ranks (every member belongs to both) are told apart by their torch names."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return None, {}
    c10d = dist.distributed_c10d
    world = c10d._get_default_group()
    names = dict(c10d._world.pg_names)
    labels = {group: "world" if group is world else ranks_label(dist.get_process_group_ranks(group))
              for group in names}
    seen = collections.Counter(labels.values())
    return world, {group: label if seen[label] == 1 else f"{label} (group {names[group]})"
                   for group, label in labels.items()}


def ranks_label(ranks: List[int]) -> str:
    """"ranks 0, 2", "ranks 0-7", "ranks 0, 8, ..., 56 (8)": a group's ranks, short at any size."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    if len(ranks) <= 4:
        return "ranks " + ", ".join(map(str, ranks))
    stride = ranks[1] - ranks[0]
    if ranks == list(range(ranks[0], ranks[-1] + 1, stride)):
        return f"ranks {ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({len(ranks)})"
    return f"ranks {ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({len(ranks)}, uneven)"


def _waited_group(frame: Optional[FrameType], waiting_in: str) -> str:
    """The label of the group the collective `waiting_in` was issued on, read from its frame's
    arguments (`group=None` is the default group); "" when no frame of it says."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == waiting_in and "/torch/distributed/" in code.co_filename.replace("\\", "/"):
            arguments = frame.f_locals
            if "group" not in arguments and "process_group" not in arguments:
                return ""
            group = arguments.get("group", arguments.get("process_group"))
            world, labels = _groups()
            return labels.get(world if group is None else group, "")
        frame = frame.f_back
    return ""


def _frames(frame: Optional[FrameType]) -> List[Tuple[str, int, str]]:
    """(file, line, function) from the innermost frame outwards."""
    frames: List[Tuple[str, int, str]] = []
    while frame is not None and len(frames) < 200:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    return frames


def is_user_frame(filename: str) -> bool:
    """The user's own code: not the standard library, an installed package or TraceML."""
    if filename.startswith("<"):
        return False
    path = os.path.normcase(os.path.abspath(filename))
    return not path.startswith(_LIBRARY_ROOTS) and "site-packages" not in path and "dist-packages" not in path


def _read(frames: List[Tuple[str, int, str]]) -> Tuple[str, str]:
    """(the collective or wait the thread is in, or ""; "checkpoint", "compile" or "")."""
    waiting_in = activity = ""
    for filename, _, function in frames:
        path = filename.replace("\\", "/")
        if not waiting_in and "/torch/distributed/" in path and function in _COLLECTIVE_WAITS:
            waiting_in = function
        elif not waiting_in and path.endswith("/torch/utils/data/dataloader.py"):
            waiting_in = "DataLoader"
        # A collective inside a dynamo-disabled function (FSDP2's) is a wait, not a compilation.
        if not activity and not waiting_in and ("/torch/_dynamo/" in path or "/torch/_inductor/" in path):
            activity = Beside.COMPILE
        elif not activity and (path.endswith("/torch/serialization.py") and function in ("save", "_save")
                               or "save_checkpoint" in function):
            activity = Beside.CHECKPOINT
    return waiting_in, activity

