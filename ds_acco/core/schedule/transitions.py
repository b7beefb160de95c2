"""What a phase end does, per mode and phase ended: one table, read top to bottom (:data:`TRANSITIONS`).

:meth:`.machine.AccoSchedule.end_phase` interprets a row: collect the round in flight (wait for it and
swap its weights into the live ones), advance the step, launch the next round (pack G into B), pick
the next phase. A new mode is new rows. Mode 'auto' runs its candidates' rows (its stock: SYNC). Swaps are in ACCO.md's notation (G: the gradient buffer,
B: the communication buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..round.rounds import RoundKind
from .phases import PhaseKind


@dataclass(frozen=True)
class Transition:
    """One phase end.

    Attributes:
        collect: wait for the round in flight and put its weights into the live ones.
        advance_step: the step index moves on (after the collection: the next round is the next step's).
        launch: the kind of the round launched.
        clear_grads: G ← 0 once packed into B (else G keeps its sum: the estimate's, for the commit).
        sync: stock's step: the round is launched first and collected at once (nothing overlaps).
        first_half_weight: the round collected is the estimate, whose weight the commit launched uses.
        next_phase: the phase that begins (None: :meth:`.machine.AccoSchedule.opening_phase` of the step).
        data_step: the step whose data the ended phase computed, relative to the step index when it
            ended (None: no step's, recorded as 0).
    """

    collect: bool
    advance_step: bool
    launch: RoundKind
    clear_grads: bool
    next_phase: Optional[PhaseKind]
    data_step: Optional[int]
    sync: bool = False
    first_half_weight: bool = False


E, C = RoundKind.ESTIMATE, RoundKind.COMMIT
P = PhaseKind
# a step of the synchronous warm-up: B ← G; G ← 0; round C_t waited for at once; model ← θ_{t+1}.
TRANSITIONS_SYNC = Transition(collect=True, advance_step=True, launch=C, clear_grads=True, next_phase=None,
                              data_step=0, sync=True)

TRANSITIONS: Dict[Tuple[str, PhaseKind], Transition] = {
    # mode 'acco'
    # bootstrap: G (at θ_0) into B, round E_0; G keeps it.
    ("acco", P.BOOTSTRAP): Transition(collect=False, advance_step=False, launch=E, clear_grads=False,
                                      next_phase=P.ESTIMATE, data_step=None),
    # phase E_t ends: model ← θ̃_{t+1}; B ← G (the full batch of step t); G ← 0; round C_t.
    ("acco", P.ESTIMATE): Transition(collect=True, advance_step=False, launch=C, clear_grads=True,
                                     next_phase=P.COMMIT, data_step=0, first_half_weight=True),
    # phase C_t ends: model ← θ_{t+1}; t ← t + 1; B ← G (Σg̃_{t+1}, kept in G); round E_{t+1}.
    ("acco", P.COMMIT): Transition(collect=True, advance_step=True, launch=E, clear_grads=False,
                                   next_phase=P.ESTIMATE, data_step=1),
    ("acco", P.SYNC): TRANSITIONS_SYNC,
    # mode 'dpu': commit rounds only.
    # bootstrap: B ← G; G ← 0; round 0.
    ("dpu", P.BOOTSTRAP): Transition(collect=False, advance_step=False, launch=C, clear_grads=True,
                                     next_phase=P.COMMIT, data_step=None),
    # phase k ends: model ← θ_k; k ← k + 1; B ← G; G ← 0; round k.
    ("dpu", P.COMMIT): Transition(collect=True, advance_step=True, launch=C, clear_grads=True,
                                  next_phase=P.COMMIT, data_step=1),
    # mode 'one_round': dpu's rows; each commit round gathers P_{k+2} in θ_{k+1}'s place (core/step/predict.py).
    # bootstrap: B ← G; G ← 0; round 0.
    ("one_round", P.BOOTSTRAP): Transition(collect=False, advance_step=False, launch=C, clear_grads=True,
                                           next_phase=P.COMMIT, data_step=None),
    # a step of the synchronous warm-up: acco's row (the round writes θ_{t+1}, no prediction); the bootstrap
    # after it starts the predictor at θ_K.
    ("one_round", P.SYNC): TRANSITIONS_SYNC,
    # phase k ends: model ← P_{k+1}; k ← k + 1; B ← G; G ← 0; round k.
    ("one_round", P.COMMIT): Transition(collect=True, advance_step=True, launch=C, clear_grads=True,
                                        next_phase=P.COMMIT, data_step=1),
}
