"""CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's launch scripts export it) on an accelerator: rounds and
the compute side's collectives on other communicators would share one hardware queue in orders that
differ between ranks (a deadlock), so the rounds run synchronously, with a warning that says why and
names the fix (docs/collective_order.md). The driver's use of it: tests/deepspeed/test_teardown.py."""
import pytest
import torch

from ds_acco.core.driver import one_queue_serialisation
from ds_acco.core.checks.warning_rows import WARNINGS

GPU = torch.device("cuda", 3)  # a device object only: nothing runs on it


def test_one_queue_on_an_accelerator_serialises_the_rounds_and_says_why(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    message = one_queue_serialisation(GPU, synchronous=False)
    assert message is not None
    for words in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "one hardware queue", "deadlock across ranks",
                  "run synchronously", "nothing overlaps", "unset CUDA_DEVICE_MAX_CONNECTIONS"):
        assert words in message, words
    assert one_queue_serialisation(torch.device("xpu", 0), synchronous=False) == message
    assert message.endswith("; fix: " + WARNINGS["one_hardware_queue"].fix)


@pytest.mark.parametrize("value, device, synchronous", [
    (None, GPU, False),  # unset: the driver's default queues
    ("8", GPU, False),
    ("32", GPU, False),
    (" 1x", GPU, False),  # not a number: the driver ignores it too
    ("1", torch.device("cpu"), False),  # no streams on CPU
    ("1", GPU, True),  # already synchronous
])
def test_nothing_to_serialise_where_it_does_not_apply(monkeypatch, value, device, synchronous):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    assert one_queue_serialisation(device, synchronous) is None
