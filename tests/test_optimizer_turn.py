"""The optimizer turn alone: which update (or backward) ends an inferred step, driven by ids."""
from traceml.probe.turns import TURN_LEFT_UPDATES, OptimizerTurn
from traceml.records import STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER

ADAM, DISCRIMINATOR, GENERATOR, FINE_TUNE = 101, 202, 303, 404  # optimizers' ids, as id() gives them


def make_turn(optimizer_made=True):
    said = []
    return OptimizerTurn(said.append, lambda: optimizer_made), said


def drive(turn, optimizer_ids, step=0):
    """Each update in order, as the probe tells the turn: the decisions, and the steps ended."""
    decisions = []
    for optimizer_id in optimizer_ids:
        ends = turn.update_ends_step(optimizer_id, step)
        decisions.append(ends)
        step += ends
    return decisions, step


def test_one_optimizer_ends_every_step_and_settles_at_its_second_update():
    turn, said = make_turn()
    assert drive(turn, [ADAM]) == ([True], 1)
    assert turn.step_optimizer == ADAM and turn.settled is None  # once round: the turn is not known yet
    assert drive(turn, [ADAM] * 4, step=1) == ([True] * 4, 5)
    assert turn.settled == ADAM
    assert said == []  # steps came from the optimizer all along, as the probe was made saying


def test_a_gan_step_is_one_turn_ended_by_the_generators_update():
    turn, _ = make_turn()
    decisions, steps = drive(turn, [DISCRIMINATOR, GENERATOR] * 5)
    # The first update seen ends the first step; once the discriminator comes round again, the
    # generator, which updated just before it, is the last of the turn and ends each step.
    assert decisions == [True, False, False, True, False, True, False, True, False, True]
    assert steps == 5
    assert turn.step_optimizer == turn.settled == GENERATOR


def test_gradient_accumulation_ends_a_step_at_the_update_not_at_each_backward():
    turn, said = make_turn(optimizer_made=True)
    decisions = []
    for step in range(3):
        for _ in range(4):  # four micro-batches' backwards, then the update
            decisions.append(("backward", turn.backward_ends_step()))
        decisions.append(("update", turn.update_ends_step(ADAM, step)))
    assert decisions == [("backward", False)] * 4 + [("update", True)] + (
        [("backward", False)] * 4 + [("update", True)]) * 2
    assert turn.settled == ADAM and said == []


def test_an_optimizer_updating_turn_left_updates_times_in_one_step_takes_over():
    turn, _ = make_turn()
    assert drive(turn, [ADAM] * 3) == ([True] * 3, 3)
    # Another optimizer once a step beside the one ending steps (an EMA, a GAN's other half)
    # never takes over: its count starts again each step.
    decisions, step = drive(turn, [FINE_TUNE, ADAM] * 3, step=3)
    assert decisions == [False, True] * 3 and step == 6 and turn.settled == ADAM
    # Fine-tuning: the first optimizer no longer updates; the new one's updates end no step
    # until the TURN_LEFT_UPDATES-th in the same step, which ends it and starts the turn anew.
    decisions = [turn.update_ends_step(FINE_TUNE, 6) for _ in range(TURN_LEFT_UPDATES)]
    assert decisions == [False] * (TURN_LEFT_UPDATES - 1) + [True]
    assert turn.step_optimizer == FINE_TUNE and turn.settled is None
    assert drive(turn, [FINE_TUNE] * 2, step=7) == ([True, True], 9)
    assert turn.settled == FINE_TUNE


def test_backward_ends_steps_with_no_optimizer_until_one_comes_late_and_takes_over():
    turn, said = make_turn(optimizer_made=False)
    assert [turn.backward_ends_step() for _ in range(3)] == [True, True, True]
    assert said == [STEPS_FROM_BACKWARD]  # said once, at the first backward
    # An optimizer made later: its first update ends the step, and from then on it decides.
    assert turn.update_ends_step(ADAM, 3) is True
    assert said == [STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER]
    assert [turn.backward_ends_step() for _ in range(2)] == [False, False]
    assert drive(turn, [ADAM] * 2, step=4) == ([True, True], 6)
    assert turn.settled == ADAM and said == [STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER]


def test_backward_ends_no_step_once_an_optimizer_is_made_even_before_its_first_update():
    turn, said = make_turn(optimizer_made=True)
    assert [turn.backward_ends_step() for _ in range(2)] == [False, False]
    assert turn.update_ends_step(ADAM, 0) is True
    assert said == []  # no switch to tell: backward never ended steps
