"""CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron sets it) is detected on an accelerator with asynchronous
rounds and explained; the driver's call of this check is tested in tests/deepspeed/test_teardown.py."""
import pytest
import torch

from ds_acco.core.driver import one_connection_warning

GPU = torch.device("cuda", 3)  # a device object only: nothing runs on it


def test_one_connection_on_an_accelerator_warns_with_the_consequence_and_the_fix(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    message = one_connection_warning(GPU, synchronous=False)
    assert message is not None
    for words in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "side stream and the compute stream share",
                  "serialised with the compute kernels", "overlap", "deadlock across ranks",
                  "unset CUDA_DEVICE_MAX_CONNECTIONS", "acco.synchronous = true"):
        assert words in message, words
    assert one_connection_warning(torch.device("xpu", 0), synchronous=False) == message


@pytest.mark.parametrize("value, device, synchronous", [
    (None, GPU, False),  # unset
    ("8", GPU, False),
    ("32", GPU, False),
    ("1", torch.device("cpu"), False),  # no streams on CPU
    ("1", GPU, True),  # synchronous rounds overlap nothing: nothing to lose
])
def test_no_warning_where_it_does_not_apply(monkeypatch, value, device, synchronous):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    assert one_connection_warning(device, synchronous) is None
