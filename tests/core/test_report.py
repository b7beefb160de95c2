"""A round's report (core/round/report.py): named fields packed into the counts table and read back by
name on every rank; a new field widens the row instead of displacing the stop request or the
drain flag; checkpoints keep the reports by name and still read the positional rows of earlier
versions."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from ds_acco.comm import collectives
from ds_acco.core.round import rounds
from ds_acco.core.driver import AccoDriver
from ds_acco.core.round.kinds import Tally
from ds_acco.core.round.report import DRAIN_ABORT, RoundReport, reports_from_checkpoint
from ds_acco.core.round.rounds import DrainMismatchError, RoundKind, RoundResult, check_no_drain_abort
from ds_acco.core.schedule.drains import flagged
from ds_acco.core.schedule.machine import AccoSchedule
from ds_acco.core.lifecycle.metrics import StepMetrics


@dataclasses.dataclass(frozen=True)
class WiderReport(RoundReport):
    """RoundReport with one more field, as the next metric would add it."""
    queue_s: float = 0.25


def distinct(cls, rank: int):
    """A report whose every field holds a value no other field (and no other rank) holds."""
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        kind = type(f.default)
        values[f.name] = (rank % 2 == 0) if kind is bool else kind(100 * rank + i + 1) + (0.5 if kind is float else 0)
    return cls(**values)


@pytest.mark.parametrize("cls", [RoundReport, WiderReport])
def test_every_field_survives_the_table_by_name(cls):
    sent = [distinct(cls, r) for r in range(3)]
    table = torch.tensor([r.pack() for r in sent], dtype=torch.float64)
    assert table.shape == (3, len(dataclasses.fields(cls))) == (3, cls.width())
    assert cls.unpack(table) == sent


def test_a_table_of_the_wrong_width_is_refused():
    table = torch.zeros(2, RoundReport.width() - 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(world, 8\).*got rows of \[7\] floats.*fix: run the same ds_acco"):
        RoundReport.unpack(table)
    with pytest.raises(ValueError, match="must be"):
        WiderReport.unpack(torch.zeros(2, RoundReport.width(), dtype=torch.float64))  # a field short


def _exchange(monkeypatch, mine: RoundReport, peer: RoundReport):
    """exchange_tallies on rank 0 of 2, the all-gather played by a stand-in that puts the peer's
    row (packed by the same code) after this rank's."""
    def fake_gather(shard, flat, group):
        other = torch.tensor([5.0, 5.0] + peer.pack(), dtype=torch.float64)
        flat.copy_(torch.cat([shard, other]))
    monkeypatch.setattr(collectives, "gather_shards", fake_gather)
    ctx = SimpleNamespace(groups=[SimpleNamespace(comm=torch.zeros(1))], world=2, process_group=None)
    return rounds.exchange_tallies(ctx, Tally(3, 2.5), mine)


@pytest.mark.parametrize("cls", [RoundReport, WiderReport])
def test_stop_request_and_drain_flags_travel_whatever_the_fields(monkeypatch, cls):
    # This rank's report as the schedule builds it for a drain probe: the driver's report (its
    # metrics and stop request) with the drain fields filled in.
    driver_report = dataclasses.replace(distinct(cls, 1), stop=False, drain=0, drain_at=0)
    schedule = SimpleNamespace(report=lambda: driver_report, micro_batches=17, seconds_per_micro_batch=0.125)
    mine = AccoSchedule.round_report(schedule, drain=4)
    assert type(mine) is cls and (mine.drain, mine.drain_at, mine.stop) == (4, 17, False)
    assert mine.compute_s_per_micro_batch == 0.125
    peer = dataclasses.replace(distinct(cls, 2), stop=True, drain=0, drain_at=0)
    per_rank, reports = _exchange(monkeypatch, mine, peer)
    assert per_rank == [Tally(3, 2.5), Tally(5, 5.0)]
    assert reports == [mine, peer]
    result = RoundResult(RoundKind.COMMIT, 0, Tally(3, 2.5), per_rank, 1.0, peer_report=reports)
    assert flagged(result, 4) and not flagged(result, 3)
    stub = SimpleNamespace(schedule=SimpleNamespace(recent_rounds=[result]))
    assert AccoDriver.stop_requested_by_any_rank(stub)
    check_no_drain_abort(reports)
    aborting = dataclasses.replace(peer, stop=False, drain=DRAIN_ABORT)
    _, reports = _exchange(monkeypatch, mine, aborting)
    with pytest.raises(DrainMismatchError, match=r"rank\(s\) \[1\]"):
        check_no_drain_abort(reports)
    stub.schedule.recent_rounds = [RoundResult(RoundKind.COMMIT, 0, Tally(), per_rank, 1.0, peer_report=reports)]
    assert not AccoDriver.stop_requested_by_any_rank(stub)


def test_metrics_send_their_figures_by_name_and_read_the_peers_by_name():
    metrics = StepMetrics("acco")
    assert all(math.isnan(getattr(metrics.report(), k)) for k in ("exposed_comm_s", "comm_s", "micro_batches",
                                                                   "step_time_s"))
    estimate = RoundResult(RoundKind.ESTIMATE, 0, Tally(4, 4.0), [Tally(4, 4.0)], 1.0, started_at=0.0,
                           finished_at=0.5, wait_s=0.125)
    peers = [RoundReport(exposed_comm_s=0.5, comm_s=2.0, micro_batches=3.0, step_time_s=7.0),
             RoundReport(exposed_comm_s=1.5, comm_s=4.0, micro_batches=5.0, step_time_s=9.0)]
    commit = RoundResult(RoundKind.COMMIT, 0, Tally(6, 6.0), [Tally(6, 6.0)], 1.0, peer_report=peers,
                         started_at=1.0, finished_at=2.0, wait_s=0.25, collected_at=10.0)
    metrics.on_commit(commit, [estimate], [])
    rec = metrics.on_commit(dataclasses.replace(commit, collected_at=13.0), [estimate], [])
    assert rec["prev_step_exposed_comm_s_per_rank"] == [0.5, 1.5]
    assert rec["prev_step_micro_batches_per_rank"] == [3, 5]
    assert rec["prev_step_exposed_comm_s_max"] == 1.5
    sent = metrics.report()
    assert (sent.exposed_comm_s, sent.comm_s, sent.micro_batches, sent.step_time_s) == (
        rec["exposed_comm_s"], rec["comm_s"], rec["micro_batches"], rec["step_time_s"]) == (0.375, 1.5, 6, 3.0)
    assert (sent.stop, sent.drain, sent.drain_at) == (False, 0, 0)  # the driver and the schedule fill these
    nan_peer = [dataclasses.replace(peers[0], exposed_comm_s=math.nan), peers[1]]
    rec = metrics.on_commit(dataclasses.replace(commit, peer_report=nan_peer), [estimate], [])
    assert "prev_step_exposed_comm_s_per_rank" not in rec  # a rank without a committed step yet


def test_checkpoints_keep_reports_by_name_in_plain_types():
    reports = [distinct(RoundReport, 0), distinct(RoundReport, 1)]
    result = RoundResult(RoundKind.COMMIT, 3, Tally(2, 2.0), [Tally(2, 2.0), Tally(3, 3.0)], 0.5,
                         peer_report=reports)
    saved = result.to_dict()
    assert saved["peer_report"] == [dataclasses.asdict(r) for r in reports]
    assert all(type(v) in (float, int, bool) for d in saved["peer_report"] for v in d.values())
    assert RoundResult.from_dict(saved) == result
    # A field added since the save takes its default; one since removed is dropped.
    older = dict(saved, peer_report=[dict(d, retired=1.0) for d in saved["peer_report"]])
    del older["peer_report"][0]["drain_at"]
    assert [r.drain_at for r in RoundResult.from_dict(older).peer_report] == [0, reports[1].drain_at]


@pytest.mark.parametrize("width", [6, 7])
def test_positional_rows_of_earlier_checkpoints_are_read_by_their_layout(width):
    # state version 3 before the report was named: 4 metrics, the stop request, then the drain
    # flag (6 floats) or the drain's micro-batch count and the flag (7 floats)
    rows = [[0.5, 2.0, 3.0, 7.0, 0.0, 9.0, 2.0], [1.5, 4.0, 5.0, 9.0, 1.0, 0.0, DRAIN_ABORT]]
    if width == 6:
        rows = [r[:5] + r[6:] for r in rows]
    reports = reports_from_checkpoint(torch.tensor(rows, dtype=torch.float64))
    assert reports[0] == RoundReport(0.5, 2.0, 3.0, 7.0, stop=False, drain=2, drain_at=9 if width == 7 else 0)
    assert reports[1] == RoundReport(1.5, 4.0, 5.0, 9.0, stop=True, drain=DRAIN_ABORT, drain_at=0)


def test_a_positional_row_of_no_known_layout_is_refused():
    with pytest.raises(ValueError, match=r"shape \(2, 5\).*fix: resume with the ds_acco version"):
        reports_from_checkpoint(torch.zeros(2, 5, dtype=torch.float64))
