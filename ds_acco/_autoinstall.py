"""``DS_ACCO_INSTALL=1``: :func:`ds_acco.install` runs as soon as ``deepspeed`` is imported.

Loaded at interpreter start-up by ``ds_acco_autoinstall.pth`` (installed next to the package in
site-packages) only when the variable is set to something other than ``""``, ``0``, ``false`` or
``no``; unset, the ``.pth`` line costs one dictionary lookup and never imports this module. It
adds a one-shot import hook: when a program imports ``deepspeed``, the module runs normally and
``ds_acco.install()`` follows before the ``import`` returns, so ``deepspeed.initialize`` is already
the router when the program looks it up (``from deepspeed import initialize`` included). Nothing
here may fail a program: any error becomes a warning on stderr.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

ENV = "DS_ACCO_INSTALL"


def enabled(environ=None) -> bool:
    import os
    return (environ if environ is not None else os.environ).get(ENV, "").strip().lower() not in ("", "0", "false",
                                                                                                  "no")


def _warn(what: str, exc: BaseException) -> None:
    print(f"ds_acco: {ENV} is set but {what} failed: {exc!r}; running without ACCO", file=sys.stderr)


def _install_after(loader_exec):
    def exec_module(module):
        loader_exec(module)
        try:
            import ds_acco
            ds_acco.install()
        except Exception as exc:  # noqa: BLE001 -- never fail the user's program
            _warn("ds_acco.install()", exc)
    return exec_module


class _DeepSpeedHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        _remove()
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module = _install_after(spec.loader.exec_module)
            return spec
        except Exception as exc:  # noqa: BLE001
            _warn("the import hook", exc)
            return None


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DeepSpeedHook)]


def activate() -> None:
    """Install ds_acco now if deepspeed is already imported, else when it is."""
    try:
        if "deepspeed" in sys.modules:
            import ds_acco
            ds_acco.install()
        elif not any(isinstance(f, _DeepSpeedHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _DeepSpeedHook())
    except Exception as exc:  # noqa: BLE001
        _warn("activation", exc)


if enabled():
    activate()
