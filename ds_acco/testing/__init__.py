"""Test doubles for ds_acco's protocols, shipped so that downstream checks can use them too.

* :mod:`.recording`: :class:`~ds_acco.testing.recording.RecordingAccelerator`, the lane's stream
  protocol made checkable without a GPU (tests/comm/test_stream_protocol.py, scripts/gpu_check.py);
  :mod:`.op_recorders`, the torch modes that attribute a thread's ops and host reads to it.

Nothing in the library imports this package; a training job never needs it.
"""
