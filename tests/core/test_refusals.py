"""The refusals table (ds_acco/core/checks/refusals.py): every row says what it refuses, why and the fix,
and some test reaches it (by its key: a test asserts the error's ``refusal`` or names the row)."""
import re
from pathlib import Path

import pytest

from ds_acco.core.checks.refusals import LAYOUT_REFUSALS, REFUSALS, AccoRefusal, ParallelLayout, check_layout, refuse
from ds_acco.config import AccoConfig

TESTS = Path(__file__).resolve().parents[1]
FIELDS = dict(accumulation="dynamic", even=2, optimizer="SGD", comm_dtype="torch.bfloat16")


@pytest.mark.parametrize("key", sorted(REFUSALS))
def test_every_row_names_what_why_and_fix_and_its_message_quotes_them(key):
    row = REFUSALS[key]
    assert row.key == key and row.what and len(row.why) > 10 and len(row.fix) > 10
    message = row.message("SETTING = 1", **FIELDS)
    why, fix = (row.why, row.fix)
    for name, value in {**FIELDS, "uneven_steps": ""}.items():
        why, fix = why.replace("{" + name + "}", str(value)), fix.replace("{" + name + "}", str(value))
    assert why.split("{uneven_steps}")[0] in message
    assert message.endswith("; fix: " + fix)
    assert not re.search(r"\{(accumulation|uneven_steps|even|optimizer|comm_dtype|found|why|fix)\}", message)
    error = refuse(key, "SETTING = 1", **FIELDS)
    assert type(error) is AccoRefusal and isinstance(error, ValueError)  # issue 41: a ValueError of its own type
    assert error.refusal == key and error.row is row and str(error) == message


def _test_sources():
    return {p: p.read_text() for p in TESTS.rglob("*.py") if p.resolve() != Path(__file__).resolve()}


# Rows no configuration reaches with the DeepSpeed this suite runs: guards against a change in it.
UNREACHABLE = {
    # DeepSpeed 0.19 builds its ZeRO optimizer (ours) for every stage-1 config with an optimizer; without
    # one it asserts "zero stage 1 requires an optimizer" first, and other stages are refused by zero_stage.
    "not_zero1_optimizer",
}


@pytest.mark.parametrize("key", sorted(set(REFUSALS) - UNREACHABLE))
def test_every_row_is_reached_by_a_test(key):
    reached = [p for p, text in _test_sources().items() if f'"{key}"' in text or f"'{key}'" in text]
    assert reached, f"no test names the refusal {key!r}: add one that reaches it and asserts its key"


def test_a_layout_refusal_raises_the_first_row_that_applies_with_its_key():
    layout = ParallelLayout(pipeline_parallel=2, pipeline_parallel_from="mpu.p()", expert_params=("e",))
    with pytest.raises(ValueError) as caught:
        check_layout(AccoConfig(enabled=True), layout)
    assert caught.value.refusal == "pipeline_parallel" == LAYOUT_REFUSALS[0].key
    check_layout(AccoConfig(enabled=False), layout)  # a disabled block trains stock: nothing refused


def test_ranks_that_differ_read_as_they_always_did():
    """check_same_on_all_ranks (core/driver.py) raises the ``ranks_differ`` row: the message is
    byte for byte the one it raised before the row existed (tests and users match it)."""
    lines = 'rank 0: {"acco": {"enabled": true}}; rank 1: {"acco": null}'
    error = refuse("ranks_differ", "ACCO settings", lines=lines)
    assert error.refusal == "ranks_differ"
    assert str(error) == f"ACCO settings differs between ranks: {lines}; fix: give every rank the same config"



def _raised(call):
    with pytest.raises(AccoRefusal) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("call, key", [
    # a layout row: its found_in lambda cannot be pickled, so the row must not travel
    (lambda: check_layout(AccoConfig(enabled=True), ParallelLayout(pipeline_parallel=2, pipeline_parallel_from="pp")),
     "pipeline_parallel"),
    (lambda: AccoConfig.from_block({"enabled": True, "acumulation": "dynamic"}), "acco_unknown_key"),
])
def test_a_refusal_survives_pickle_and_copy(call, key):
    """A process pool or launcher sends exceptions between processes by pickle: the twin is rebuilt from
    its message and its row's key, through the table."""
    import copy
    import pickle
    error = _raised(call)
    for twin in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(twin) is AccoRefusal and str(twin) == str(error) and twin.args == error.args
        assert twin.refusal == key and twin.row is REFUSALS[key]
