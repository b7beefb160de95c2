"""The schedule's position (core/schedule/position.py): its move is dataclasses.replace, faster."""
import dataclasses

import pytest

from ds_acco.core.round.kinds import Tally
from ds_acco.core.schedule.phases import PhaseKind
from ds_acco.core.schedule.position import Position


def test_a_move_is_dataclasses_replace_and_leaves_the_old_position_as_it_was():
    old = Position(PhaseKind.ESTIMATE, step_index=3, committed_steps=3, phase_tally=Tally(2, 2.0),
                   buffer_tally=Tally(6, 6.0), micro_batches=14, accumulated_loss_scale=2.0 ** 10)
    snapshot = dataclasses.asdict(old)
    changes = dict(phase=PhaseKind.COMMIT, phase_tally=Tally(), micro_batches=15, decision=(14, "fixed"))
    new = old.moved(**changes)
    assert new == dataclasses.replace(old, **changes) and type(new) is Position
    assert dataclasses.asdict(old) == snapshot  # a value: the old one is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.micro_batches = 0


def test_a_move_to_a_field_the_position_does_not_have_is_refused():
    with pytest.raises(TypeError, match="step_idx"):
        Position(PhaseKind.BOOTSTRAP).moved(step_idx=1)
