"""Which of DeepSpeed's JIT-compiled CPU optimizer ops a test may use without a build of minutes."""
from __future__ import annotations

import importlib
import os
from typing import Optional

BUILD_HINT = ("its JIT build takes minutes; run once with DS_ACCO_BUILD_CPU_ADAM=1 to build it into "
              "TORCH_EXTENSIONS_DIR")


def op_unavailable(builder_name: str) -> Optional[str]:
    """None when DeepSpeed's op ``builder_name`` (e.g. ``"CPUAdamBuilder"``, ``"FusedAdamBuilder"``,
    resolved for the current accelerator) is installed, already built in TORCH_EXTENSIONS_DIR, or may
    be built now (``DS_ACCO_BUILD_CPU_ADAM=1``); else why not (a skip reason)."""
    try:
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder(builder_name)
    except Exception as e:  # pragma: no cover - DeepSpeed absent
        return f"DeepSpeed unavailable: {e}"
    if builder is None or not builder.is_compatible():
        return f"DeepSpeed's {builder_name} op is not compatible with this machine"
    from torch.utils.cpp_extension import _get_build_directory
    installed = importlib.import_module("deepspeed.git_version_info").installed_ops.get(builder.name, False)
    built = os.path.exists(os.path.join(_get_build_directory(builder.name, verbose=False), builder.name + ".so"))
    if installed or built or os.environ.get("DS_ACCO_BUILD_CPU_ADAM") == "1":
        return None
    return f"DeepSpeed's {builder.name} op is not built ({BUILD_HINT})"
