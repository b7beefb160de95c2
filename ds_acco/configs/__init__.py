"""The ready DeepSpeed configs that ship with ds_acco (a checkout also shows them as ``ds_configs/``).

    ds_acco.configs.path("acco.json")     # full path of a shipped config ("acco" works too)
    ds_acco.configs.names()               # ('acco.json', 'acco_bf16.json', ..., 'zero1.json')
    python -m ds_acco configs [NAME]      # the same from a shell

``zero1.json`` is the stock ZeRO-1 baseline; the others differ from it only in their ``"acco"``
block and, for ``acco_bf16`` / ``acco_fp16``, the precision settings.
"""
from __future__ import annotations

import os
from typing import Tuple

FOLDER = os.path.dirname(os.path.abspath(__file__))


def names() -> Tuple[str, ...]:
    """File names of the shipped configs, sorted."""
    return tuple(sorted(f for f in os.listdir(FOLDER) if f.endswith(".json")))


def path(name: str) -> str:
    """Full path of the shipped config ``name`` (``"acco.json"`` or ``"acco"``)."""
    file = name if name.endswith(".json") else name + ".json"
    if os.path.basename(file) != file or file not in names():
        raise FileNotFoundError(f"{name!r} is not a config shipped with ds_acco; fix: use one of "
                                f"{', '.join(names())}")
    return os.path.join(FOLDER, file)


def resolve(config: str) -> str:
    """``config`` itself when it is an existing file, else the shipped config of that bare name."""
    if os.path.exists(config):
        return config
    if os.path.basename(config) == config:
        try:
            return path(config)
        except FileNotFoundError:
            pass
    raise FileNotFoundError(f"{config}: no such file, and not the name of a config shipped with ds_acco; fix: give "
                            f"a path, or one of {', '.join(names())}")


__all__ = ["FOLDER", "names", "path", "resolve"]
