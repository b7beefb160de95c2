"""Whether :func:`ds_acco.install` is in effect: a leaf module, so that the engine can ask without
importing the installer (which imports the engine)."""
from __future__ import annotations

from typing import Callable, Optional

original_initialize: Optional[Callable] = None  # deepspeed.initialize as it was before install()


def installed() -> bool:
    """True between :func:`ds_acco.install` and :func:`ds_acco.uninstall`."""
    return original_initialize is not None
