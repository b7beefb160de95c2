"""What ds_acco does when a program imports ``deepspeed``, armed at interpreter start-up by
``ds_acco_autoinstall.pth`` (installed next to the package in site-packages):

1. **Always: an enabled ``"acco"`` block never trains stock silently.** ``DeepSpeedEngine.__init__``
   first looks at the config the engine is built from (``config_class``, already parsed by
   DeepSpeed, whatever the source: a dict, a path, base64, ``args.deepspeed_config``; whoever
   builds it: ``deepspeed.initialize``, Accelerate, HF Trainer, Megatron, a direct construction,
   a pipeline engine). An enabled block on an engine that is not an ACCO engine raises before the
   engine builds anything, with the launch fix (``config.stock_engine_refusal``); ``DS_ACCO=off``
   lets it train stock on purpose (rank 0 says so once). A config without an ``"acco"`` key costs one
   dictionary lookup per engine.
2. **``DS_ACCO_INSTALL=1``** (anything but ``""``, ``0``, ``false``, ``no``): :func:`ds_acco.install`
   follows, so ``deepspeed.initialize`` routes enabled blocks to ACCO.

Start-up stays cheap: the ``.pth`` loads this file and calls :func:`activate` (importing this
module anywhere else changes nothing); *without* the ``ds_acco`` package (whose
``__init__`` imports torch through ``ds_acco.config``) and this module imports nothing but ``sys``.
It puts a finder first on ``sys.meta_path`` that finds ``deepspeed`` with the finders behind it and
wraps the found loader's ``exec_module``: when deepspeed's code has run, the two steps above follow
before the ``import`` returns, so ``deepspeed.initialize`` is already the router when the program
looks it up (``from deepspeed import initialize`` included). Probes that only look deepspeed up
(``importlib.util.find_spec("deepspeed")``, as ``transformers`` does before importing it;
``importlib.metadata``) execute nothing, so the finder stays until deepspeed has actually run and
wraps the loader of every spec it finds. Nothing here may fail a program at import: any error
becomes a warning on stderr (the refusal itself is raised when an engine is built).
"""
import sys
from _thread import get_ident  # not threading: its import costs start-up time

ENV = "DS_ACCO_INSTALL"
_MARK = "_ds_acco_autoinstall"  # on our finder, on wrapped exec_module functions and on the guarded __init__
_UNHOOKED = "deepspeed is imported without ds_acco's hook (no check of \"acco\" blocks, no DS_ACCO_INSTALL)"


def enabled(environ=None) -> bool:
    """Whether ``DS_ACCO_INSTALL`` asks for :func:`ds_acco.install` at the deepspeed import."""
    import os
    return (environ if environ is not None else os.environ).get(ENV, "").strip().lower() not in ("", "0", "false",
                                                                                                  "no")


def _warn(what: str, exc: BaseException, consequence: str) -> None:
    print(f"ds_acco: {what} failed: {exc!r}; {consequence}", file=sys.stderr)


def _install() -> None:
    try:
        import ds_acco  # deepspeed has imported torch already: the package's imports cost nothing more
        ds_acco.install()
    except Exception as exc:  # noqa: BLE001 -- never fail the user's program
        _warn(f"{ENV} is set but ds_acco.install()", exc, "running without ACCO")


# -- the guard on DeepSpeedEngine.__init__ -------------------------------------------------------------
def guard_engines(engine_class) -> None:
    """Wrap ``engine_class.__init__`` (DeepSpeed's engine) with :func:`_check_engine` (idempotent)."""
    import functools
    import inspect

    original = engine_class.__dict__["__init__"]
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        _check_engine(self, signature, args, kwargs)
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    engine_class.__init__ = __init__


def _check_engine(engine, signature, args, kwargs) -> None:
    """Refuse a stock engine built from a config whose ``"acco"`` block is enabled (see the module
    docstring); an invalid block raises ds_acco's error naming the key."""
    try:
        bound = signature.bind(engine, *args, **kwargs).arguments
    except TypeError:
        return  # DeepSpeed reports its own arguments
    raw = getattr(bound.get("config_class"), "_param_dict", None)
    if raw is None:
        raw = bound.get("config")
    if not isinstance(raw, dict) or "acco" not in raw:
        return
    from ds_acco import _routing
    from ds_acco.config import acco_config_of, note_opt_out, opted_out, stock_engine_refusal
    acco_engine = getattr(sys.modules.get("ds_acco.deepspeed.engine"), "AccoEngine", None)
    if (acco_engine is not None and isinstance(engine, acco_engine)) or not acco_config_of(raw).enabled:
        return
    if opted_out():
        note_opt_out()
        return
    raise RuntimeError("ds_acco: " + stock_engine_refusal(type(engine).__name__, _routing.installed()))


def _on_deepspeed(module) -> None:
    """Right after deepspeed's code has run: the guard, then ``ds_acco.install()`` if asked."""
    try:
        guard_engines(module.runtime.engine.DeepSpeedEngine)
    except Exception as exc:  # noqa: BLE001 -- never fail the user's program at import
        _warn("watching DeepSpeed engines for an enabled \"acco\" block", exc, "engines are built unchecked")
    if enabled():
        _install()


# -- the import hook ----------------------------------------------------------------------------------
def _wrap(spec) -> None:
    """Make ``spec``'s loader run :func:`_on_deepspeed` right after it has executed ``deepspeed``."""
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
            _on_deepspeed(module)

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
            _warn("the import hook", exc, _UNHOOKED)
            return None
        finally:
            self._busy.discard(me)


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]


def armed() -> bool:
    """Whether the hook waits on ``sys.meta_path`` for deepspeed to be imported."""
    return any(getattr(f, _MARK, False) for f in sys.meta_path)


def activate() -> None:
    """Run the deepspeed steps now if deepspeed is already imported, else right after it is."""
    try:
        if "deepspeed" in sys.modules:
            _remove()
            _on_deepspeed(sys.modules["deepspeed"])
        elif not armed():
            sys.meta_path.insert(0, _DeepSpeedHook())
    except Exception as exc:  # noqa: BLE001
        _warn("activation", exc, _UNHOOKED)

