"""What each rank sends along with a round: one named record, packed and unpacked here only.

Every round (and every drain probe) starts with one small all-gather of each rank's counts; a
:class:`RoundReport` rides along in the same row, so every rank learns its peers' figures, a stop
request and where they drain without a collective of its own. Readers use the field names. The
row's width is the number of fields, so a new field widens the table instead of displacing one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

DRAIN_ABORT = -1  # RoundReport.drain: this rank found that the ranks drained different numbers of times


@dataclass(frozen=True)
class RoundReport:
    """One rank's report, as every rank receives it (``RoundResult.peer_report[rank]``).

    The first four are this rank's figures for its last committed step (``StepMetrics``; NaN
    before its first), sent with the next round so the cross-rank timing of step t-1 is known at
    step t. ``stop``: a SIGTERM asked this rank to stop; every rank stops at the round that
    carries it. ``drain`` / ``drain_at``: dynamic mode only (core/schedule/drains.py, "Drains agree"): the
    drain this rank is in (its number; 0 outside a drain; :data:`DRAIN_ABORT`) and its
    micro-batch count then. ``compute_s_per_micro_batch``: this rank's compute seconds per
    micro-batch over its last measured phase (NaN before one; the schedule fills it): what
    accumulation 'shared' splits each phase by (phases.py, :func:`share_by_speed`)."""
    exposed_comm_s: float = math.nan
    comm_s: float = math.nan
    micro_batches: float = math.nan
    step_time_s: float = math.nan
    stop: bool = False
    drain: int = 0
    drain_at: int = 0
    compute_s_per_micro_batch: float = math.nan

    @classmethod
    def width(cls) -> int:
        """Floats one report takes in the counts table: one per field."""
        return len(dataclasses.fields(cls))

    def pack(self) -> List[float]:
        """The fields as floats, in declaration order (exact in float64: counts stay below 2**53)."""
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def unpack(cls, rows: Sequence[Sequence[float]]) -> List["RoundReport"]:
        """Every rank's report from the packed rows (host floats, one row per rank; a tensor is read
        back first)."""
        rows = rows.tolist() if torch.is_tensor(rows) else rows
        if any(len(row) != cls.width() for row in rows):
            raise ValueError(f"a table of {cls.__name__} rows must be (world, {cls.width()}), one float per "
                             f"field {[f.name for f in dataclasses.fields(cls)]}; got rows of "
                             f"{sorted({len(row) for row in rows})} floats: the ranks run different ds_acco "
                             "versions, or a row was packed elsewhere than RoundReport.pack; fix: run the same "
                             "ds_acco on every rank")
        return [cls._from_values(row) for row in rows]

    @classmethod
    def _from_values(cls, values) -> "RoundReport":
        return cls(**{f.name: _typed(f, v) for f, v in zip(dataclasses.fields(cls), values)})

    def to_dict(self) -> dict:
        """Plain types, by name (checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RoundReport":
        """From :meth:`to_dict`'s output; a field this version lacks is dropped (nothing here acts on
        it) and one that the saving version lacked takes its default."""
        return cls(**{f.name: _typed(f, d[f.name]) for f in dataclasses.fields(cls) if f.name in d})


def _typed(field: dataclasses.Field, value):
    kind = type(field.default)
    return value != 0 if kind is bool else kind(value)


# The positional rows that checkpoints (state version 3) stored before the report was named, by
# width: field names in their order then.
_LEGACY_ROWS = {
    6: ("exposed_comm_s", "comm_s", "micro_batches", "step_time_s", "stop", "drain"),
    7: ("exposed_comm_s", "comm_s", "micro_batches", "step_time_s", "stop", "drain_at", "drain"),
}


def reports_from_checkpoint(saved) -> Optional[List[RoundReport]]:
    """A restored round's per-rank reports: a list of :meth:`RoundReport.to_dict` dicts, or the
    ``(world, k)`` tensor of positional floats that earlier versions saved (read by their layout)."""
    if saved is None:
        return None
    if not torch.is_tensor(saved):
        return [RoundReport.from_dict(d) for d in saved]
    names = _LEGACY_ROWS.get(saved.shape[-1]) if saved.dim() == 2 else None
    if names is None:
        raise ValueError(f"ACCO in-flight state: a round's peer reports of shape {tuple(saved.shape)} match no "
                         f"layout this version reads (positional rows of {sorted(_LEGACY_ROWS)} floats, or named "
                         "dicts); fix: resume with the ds_acco version that saved it, or load the checkpoint's "
                         "weights without its in-flight state (a fresh phase)")
    return [RoundReport.from_dict(dict(zip(names, row))) for row in saved.tolist()]
