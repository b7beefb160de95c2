"""``DS_ACCO_INSTALL=1``: :func:`ds_acco.install` runs as soon as ``deepspeed`` is imported.

Loaded at interpreter start-up by ``ds_acco_autoinstall.pth`` (installed next to the package in
site-packages) only when the variable is set to something other than ``""``, ``0``, ``false`` or
``no``; unset, the ``.pth`` line costs one dictionary lookup and never imports this module. Set, the
line loads this file *without* the ``ds_acco`` package (whose ``__init__`` imports torch through
``ds_acco.config``), so start-up stays cheap: this module imports nothing but ``sys``.

It puts a finder first on ``sys.meta_path`` that finds ``deepspeed`` with the finders behind it and
wraps the found loader's ``exec_module``: when deepspeed's code has run, ``ds_acco.install()``
follows before the ``import`` returns, so ``deepspeed.initialize`` is already the router when the
program looks it up (``from deepspeed import initialize`` included). Probes that only look
deepspeed up (``importlib.util.find_spec("deepspeed")``, as ``transformers`` does before importing
it; ``importlib.metadata``) execute nothing, so the finder stays until deepspeed has actually run
and wraps the loader of every spec it finds. Nothing here may fail a program: any error becomes a
warning on stderr.
"""
import sys
from _thread import get_ident  # not threading: its import costs start-up time

ENV = "DS_ACCO_INSTALL"
_MARK = "_ds_acco_autoinstall"  # on our finder and on wrapped exec_module functions


def enabled(environ=None) -> bool:
    import os
    return (environ if environ is not None else os.environ).get(ENV, "").strip().lower() not in ("", "0", "false",
                                                                                                  "no")


def _warn(what: str, exc: BaseException) -> None:
    print(f"ds_acco: {ENV} is set but {what} failed: {exc!r}; running without ACCO", file=sys.stderr)


def _install() -> None:
    try:
        import ds_acco  # deepspeed has imported torch already: the package's imports cost nothing more
        ds_acco.install()
    except Exception as exc:  # noqa: BLE001 -- never fail the user's program
        _warn("ds_acco.install()", exc)


def _wrap(spec) -> None:
    """Make ``spec``'s loader run :func:`_install` right after it has executed ``deepspeed``."""
    loader = spec.loader
    run = getattr(loader, "exec_module", None)
    if run is None:
        raise TypeError(f"deepspeed's loader {loader!r} has no exec_module")
    if getattr(run, _MARK, False):
        return  # a loader shared between specs (zipimport) is wrapped once

    def exec_module(module):
        run(module)
        # A shared loader also runs other modules, and a probe may run deepspeed outside sys.modules.
        if module.__name__ == "deepspeed" and sys.modules.get("deepspeed") is module:
            _remove()
            _install()

    setattr(exec_module, _MARK, True)
    loader.exec_module = exec_module


class _DeepSpeedHook:
    """A ``sys.meta_path`` finder for ``deepspeed`` only; it stays until deepspeed has run."""

    def __init__(self):
        setattr(self, _MARK, True)
        self._busy = set()  # threads inside find_spec: a finder behind us that looks deepspeed up again
        # gets no answer from us (no recursion); other threads probing meanwhile still get a wrapped spec

    def find_spec(self, name, path=None, target=None):
        me = get_ident()
        if name != "deepspeed" or me in self._busy:
            return None
        self._busy.add(me)
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if getattr(finder, _MARK, False) or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    if spec.loader is not None:
                        _wrap(spec)
                    return spec
            return None
        except Exception as exc:  # noqa: BLE001 -- the finders behind us then answer as if we were absent
            _warn("the import hook", exc)
            return None
        finally:
            self._busy.discard(me)


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]


def armed() -> bool:
    """Whether the hook waits on ``sys.meta_path`` for deepspeed to be imported."""
    return any(getattr(f, _MARK, False) for f in sys.meta_path)


def activate() -> None:
    """Install ds_acco now if deepspeed is already imported, else right after it is."""
    try:
        if "deepspeed" in sys.modules:
            _remove()
            _install()
        elif not armed():
            sys.meta_path.insert(0, _DeepSpeedHook())
    except Exception as exc:  # noqa: BLE001
        _warn("activation", exc)


if enabled():
    activate()
