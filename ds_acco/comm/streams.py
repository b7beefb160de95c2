"""The accelerator interface the communication lane uses, and torch's implementation of it.

The lane needs six things of an accelerator, named as DeepSpeed's accelerator names them (so
``deepspeed.accelerator.get_accelerator()`` is one, unchanged):

* ``is_synchronized_device()`` -- True where kernels run at once on the host (CPU): no streams;
* ``Stream(device=...)`` -- a new stream on that device;
* ``Event()`` -- an event (its device is the one of the stream it is recorded on);
* ``stream(s)`` -- a context in which the calling thread issues its kernels on ``s``;
* ``current_stream(device_index)`` -- the calling thread's current stream on that device;
* ``set_device(index)`` -- make a device the calling thread's current one;

and of streams ``wait_event`` / ``synchronize``, of events ``record(stream)`` / ``query()`` /
``synchronize()``. The DeepSpeed adapter passes DeepSpeed's accelerator, the FSDP2 adapter
:class:`TorchAccelerator`; tests pass :class:`~ds_acco.testing.recording.RecordingAccelerator`,
which runs on CPU as if it were an asynchronous device and records the protocol.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


class TorchAccelerator:
    """The lane's accelerator interface over torch's device-generic ``torch.Stream`` / ``torch.Event``
    / ``torch.accelerator`` API (CUDA, XPU, ... whatever torch's current accelerator is)."""

    def __init__(self, device_type: Optional[str] = None):
        acc = torch.accelerator.current_accelerator() if device_type is None else torch.device(device_type)
        self.device_type = "cpu" if acc is None else acc.type

    def is_synchronized_device(self) -> bool:
        return self.device_type == "cpu"

    def Stream(self, device=None, **kwargs):  # noqa: N802 -- DeepSpeed's accelerator's name
        return torch.Stream(device=torch.device(self.device_type, _index(device)), **kwargs)

    def Event(self, **kwargs):  # noqa: N802
        return torch.Event(device=self.device_type, **kwargs)

    @contextlib.contextmanager
    def stream(self, stream):
        # set_stream also makes the stream's device current: both are restored, as torch.cuda.stream does
        device = torch.accelerator.current_device_index()
        before = torch.accelerator.current_stream(stream.device_index)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(before)
            torch.accelerator.set_device_index(device)

    def current_stream(self, device_index: Optional[int] = None):
        return torch.accelerator.current_stream(device_index)

    def set_device(self, index: int) -> None:
        torch.accelerator.set_device_index(index)


def _index(device) -> Optional[int]:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    return torch.device(device).index


def stream_accelerator(device: torch.device, accelerator=None):
    """The accelerator the lane uses for ``device``: None on CPU (no streams), else ``accelerator``
    (the adapter's: DeepSpeed's, or a test's) or torch's own."""
    if accelerator is not None:
        return accelerator
    if device.type == "cpu":
        return None
    return TorchAccelerator(device.type)
