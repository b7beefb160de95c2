"""FSDP settings the adapter does not map, refused per parameter (``_torch_internals.check_supported``)
by their rows of core/checks/refusals.py. Stand-ins for torch's private ``FSDPParam``: only the fields read."""
from types import SimpleNamespace as NS

import pytest

from ds_acco.fsdp._torch_internals import check_supported

NEEDS_DEEPSPEED_OPS = False


def _param(ndim=1, is_dtensor=False, dim=0, offload_to_cpu=False):
    return NS(mesh_info=NS(mesh=NS(ndim=ndim)), is_dtensor=is_dtensor, fsdp_placement=NS(dim=dim),
              offload_to_cpu=offload_to_cpu)


@pytest.mark.parametrize("change, key", [
    (dict(ndim=2), "fsdp_mesh"),  # HSDP, or a 2-D mesh passed whole
    (dict(dim=1), "fsdp_placement"),  # shard_placement_fn
    (dict(is_dtensor=True), "fsdp_placement"),  # tensor-parallel DTensor module parameters
    (dict(offload_to_cpu=True), "fsdp_cpu_offload"),
])
def test_unsupported_fsdp_settings_are_refused_by_their_row(change, key):
    check_supported(_param())
    with pytest.raises(ValueError) as caught:
        check_supported(_param(**change))
    assert caught.value.refusal == key and "fix:" in str(caught.value)
