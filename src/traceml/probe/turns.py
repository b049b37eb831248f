"""Inferred steps: which optimizer's update (or, with none, which backward) ends a step.

A loop with no trace_step steps its optimizers in a turn: one optimizer, each update a step;
a GAN's discriminator then its generator, one turn a step, ended by the last of the turn;
gradient accumulation, the one optimizer once a step. The first optimizer seen ends the first
step; once it comes round again, the one that updated just before it (itself, alone) is known
as the last of the turn and ends the steps. Another optimizer updating TURN_LEFT_UPDATES times
with no step ended between has taken over (fine-tuning with a new optimizer): the turn is
learnt again from it. A loop no torch.optim optimizer updates ends a step at each backward,
until an optimizer comes and takes over.

OptimizerTurn only decides; the probe ends the steps (probe/step.py, optimizer_stepped and
backward_returned), and its hot path skips the turn altogether once `settled` says which
optimizer's update ends a step.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

from traceml.records import STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER

# Another optimizer updating this many times with no step ended between means the one that
# ended steps has stopped (a new phase of training with optimizers of its own).
TURN_LEFT_UPDATES = 3


class OptimizerTurn:
    """The turn of the optimizers a loop steps, learnt from their updates (see the module).

    set_steps_from: told how steps are found (the card shows it) when backward starts or stops
    ending them; any_optimizer_made: whether the process has made an optimizer yet (asked at the
    first backward of a step with no optimizer update seen)."""

    __slots__ = ("step_optimizer", "settled", "_last_optimizer", "_turn_known", "_backward_ends_steps",
                 "_updates_in_step", "_set_steps_from", "_any_optimizer_made")

    def __init__(self, set_steps_from: Callable[[str], None], any_optimizer_made: Callable[[], bool]):
        self._set_steps_from = set_steps_from
        self._any_optimizer_made = any_optimizer_made
        self.step_optimizer: Optional[int] = None  # id() of the optimizer whose update ends a step
        # step_optimizer once the turn is known, else None: its updates end steps with nothing
        # left to learn, so the probe's hot path can end them without asking (one compare).
        self.settled: Optional[int] = None
        self._last_optimizer: Optional[int] = None  # id() of the optimizer that updated last
        self._turn_known = False  # whether step_optimizer is the last of the turn
        self._backward_ends_steps: Optional[bool] = None  # decided at the first backward
        # id() of each other optimizer -> (the step of its last update, its updates in that step)
        self._updates_in_step: Dict[int, Tuple[int, int]] = {}

    def update_ends_step(self, optimizer_id: int, step_index: int) -> bool:
        """An optimizer's update in step `step_index` (the steps ended so far): whether it ends
        that step. Not told of the settled optimizer's updates (the probe ends those itself):
        none of them changes the turn, and the last optimizer is read only until it settles."""
        last_id, self._last_optimizer = self._last_optimizer, optimizer_id
        if self.step_optimizer is None:
            self.step_optimizer = optimizer_id
            if self._backward_ends_steps:  # the optimizer came late: it decides from now on
                self._set_steps_from(STEPS_FROM_OPTIMIZER)
            self._backward_ends_steps = False
        elif optimizer_id != self.step_optimizer:
            return self._takes_over(optimizer_id, step_index)
        elif not self._turn_known:  # the first optimizer comes round again: the turn is known
            self._turn_known = True
            if last_id != optimizer_id:
                self.step_optimizer = self.settled = last_id  # another updated since: it ends the turn
                return False
            self.settled = optimizer_id
        return True

    def _takes_over(self, optimizer_id: int, step_index: int) -> bool:
        """Another optimizer's update: when it has updated TURN_LEFT_UPDATES times with no step
        ended between, the optimizer that ended steps no longer updates (fine-tuning with a new
        optimizer, a GAN after pretraining): the turn is learnt again from this one, whose update
        ends the step, as the first optimizer's did. True when it does."""
        step, updates = self._updates_in_step.get(optimizer_id, (-1, 0))
        updates = updates + 1 if step == step_index else 1
        if updates < TURN_LEFT_UPDATES:
            self._updates_in_step[optimizer_id] = (step_index, updates)
            return False
        self._updates_in_step.clear()
        self.step_optimizer, self._turn_known, self.settled = optimizer_id, False, None
        return True

    def backward_ends_step(self) -> bool:
        """A top-level backward returned inside a step: whether it ends the step. Decided at the
        first one: when no optimizer has been made by then (manual SGD, a custom update), each
        backward ends a step until an optimizer updates; never once an optimizer ends steps."""
        if self.step_optimizer is not None:
            return False
        if self._backward_ends_steps is None:
            self._backward_ends_steps = not self._any_optimizer_made()
            if self._backward_ends_steps:
                self._set_steps_from(STEPS_FROM_BACKWARD)
        return self._backward_ends_steps
