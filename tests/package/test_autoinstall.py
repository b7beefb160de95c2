"""ds_acco_autoinstall.pth in site-packages arms ds_acco's import hook at every interpreter start:
when the program imports deepspeed, a stock engine built from a config whose "acco" block is enabled
stops with the launch fix (``DS_ACCO=off`` trains stock on purpose), and with DS_ACCO_INSTALL=1
``ds_acco.install()`` runs, whatever looked deepspeed up before. Start-up loads the hook module alone
(no torch, no ds_acco package). A temporary directory read with ``site.addsitedir`` stands for
site-packages (the wheel puts the .pth there, see setup.py; tests/package/test_wheel.py runs the
installed one). The hook itself is also tested in this process on a fake ``deepspeed`` package."""
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ds_acco import _autoinstall
from timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
NEEDS_DEEPSPEED_OPS = False


def _python(tmp_path, code, **env_extra):
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(REPO / "ds_acco_autoinstall.pth", site_dir)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCO_INSTALL"}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", **env_extra)
    prog = f"import site; site.addsitedir({str(site_dir)!r})\n" + code
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=scaled(40))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1], out.stderr


@pytest.mark.slow  # fresh interpreters (~4 s)
def test_set_installs_when_deepspeed_is_imported(tmp_path):
    code = ("import sys; before = 'ds_acco' in sys.modules and sys.modules['ds_acco'].installed()\n"
            "from deepspeed import initialize\n"
            "import ds_acco\n"
            "print(before, ds_acco.installed(), getattr(initialize, '__ds_acco_router__', False))")
    line, err = _python(tmp_path, code, DS_ACCO_INSTALL="1")
    assert line == "False True True", err[-2000:]
    line, _ = _python(tmp_path, "import sys; import deepspeed; print('ds_acco' in sys.modules)", DS_ACCO_INSTALL="0")
    assert line == "False"


@pytest.mark.parametrize("install", ["", "1"])
def test_start_up_loads_only_the_hook(tmp_path, install):
    """The .pth loads ds_acco/_autoinstall.py alone, set or not: not the package, whose __init__ imports
    torch; the hook waits for deepspeed."""
    line, err = _python(tmp_path, "import sys; a = sys.modules['ds_acco._autoinstall']\n"
                        "print(sorted(m for m in ('ds_acco', 'ds_acco.config', 'torch', 'deepspeed', 'pydantic') "
                        "if m in sys.modules), a.armed(), a.__file__)", DS_ACCO_INSTALL=install)
    assert line == f"[] True {REPO / 'ds_acco' / '_autoinstall.py'}", err[-2000:]
    assert "Error processing" not in err


@pytest.mark.slow  # fresh interpreters (~3 s)
def test_probes_before_the_import_keep_the_hook(tmp_path):
    """transformers looks deepspeed up (find_spec, then its metadata) before importing it; none of
    that runs deepspeed, so the import that follows still installs ds_acco."""
    code = ("import importlib.metadata, importlib.util, sys\n"
            "from ds_acco import _autoinstall as a\n"
            "from transformers.integrations import is_deepspeed_available\n"
            "armed = []\n"
            "for probe in (lambda: importlib.util.find_spec('deepspeed'), lambda: importlib.util.find_spec('deepspeed'),\n"
            "              lambda: importlib.metadata.version('deepspeed'), is_deepspeed_available,\n"
            "              is_deepspeed_available):\n"
            "    assert probe()\n"
            "    armed.append(a.armed() and 'deepspeed' not in sys.modules)\n"
            "import deepspeed, ds_acco\n"
            "print(all(armed), ds_acco.installed(), getattr(deepspeed.initialize, '__ds_acco_router__', False), "
            "a.armed())")
    line, err = _python(tmp_path, code, DS_ACCO_INSTALL="1")
    assert line == "True True True False", err[-2000:]


# -- an enabled "acco" block never trains stock silently (tests/launch/acco_block_guard.py) -------------
GUARD_SCRIPT = REPO / "tests" / "launch" / "acco_block_guard.py"
STOCK = 'this DeepSpeed config has "acco": {"enabled": true}, but the engine being built is a stock DeepSpeedEngine'
LAUNCH_FIX = [STOCK, "python -m ds_acco run SCRIPT.py", "torchrun ... -m ds_acco run", "--module ds_acco run",
              "DS_ACCO_INSTALL=1", "ds_acco.install()", "set DS_ACCO=off"]
# case -> the engine class it builds, or (the exception, what its message must say)
GUARD_EXPECTED = {
    "config-dict": ("RuntimeError", LAUNCH_FIX), "config-path": ("RuntimeError", LAUNCH_FIX),
    "config-base64": ("RuntimeError", LAUNCH_FIX), "config_params": ("RuntimeError", LAUNCH_FIX),
    "megatron-args": ("RuntimeError", LAUNCH_FIX), "looked-up-early": ("RuntimeError", LAUNCH_FIX),
    "engine-direct": ("RuntimeError", LAUNCH_FIX), "accelerate": ("RuntimeError", LAUNCH_FIX),
    "hf-trainer": ("RuntimeError", LAUNCH_FIX),
    "invalid-block": ("AccoRefusal", ["acco.enabled = 'yes'", "fix:"]),
    "no-block": "DeepSpeedEngine", "disabled-block": "DeepSpeedEngine", "opt-out": "DeepSpeedEngine",
    "opt-out-accelerate": "DeepSpeedEngine", "opt-out-ds_acco.initialize": "DeepSpeedEngine",
    "opt-out-unknown-value": ("ValueError", ["DS_ACCO = 'on': unknown value", "fix: DS_ACCO=off"]),
    "ds_acco.initialize": "AccoEngine", "installed-config-base64": "AccoEngine", "installed-accelerate": "AccoEngine",
    "installed-looked-up-early": ("RuntimeError", [STOCK, "ds_acco.install() is in effect, but this engine did not "
                                                   "come through it", "set DS_ACCO=off"]),
}
OPT_OUT_NOTE = "ds_acco: DS_ACCO=off: the config's \"acco\" block is enabled but ignored; DeepSpeed trains stock ZeRO"


def check_guard_run(stdout: str, stderr: str) -> None:
    """What tests/launch/acco_block_guard.py printed matches :data:`GUARD_EXPECTED`, case by case."""
    got, name = {}, None
    for line in stdout.splitlines():
        if line.startswith("CASE "):
            name = line[5:]
        elif line.startswith("OUTCOME "):
            got[name] = json.loads(line[8:])
    assert list(got) == list(GUARD_EXPECTED), (list(got), stderr[-3000:])
    for name, want in GUARD_EXPECTED.items():
        out = got[name]
        if isinstance(want, str):
            assert out == {"engine": want}, (name, out)
        else:
            assert out.get("refused") == want[0], (name, out)
            missing = [w for w in want[1] if w not in out["message"]]
            assert not missing, (name, missing, out["message"])
    assert stderr.count(OPT_OUT_NOTE) == 1  # once per process, on rank 0


def guard_env(base: dict) -> dict:
    """``base`` without ds_acco's switches, as one CPU rank of a world of 1."""
    env = {k: v for k, v in base.items() if k not in ("DS_ACCO_INSTALL", "DS_ACCO")}
    env.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow  # fresh interpreters under four launchers (~6 s)
def test_an_enabled_block_never_trains_stock_silently(tmp_path):
    """Every way the script builds an engine from an enabled block without ds_acco routing it (dict,
    path, base64, config_params, Megatron's args, an initialize looked up early, a direct engine,
    Accelerate, HF Trainer) stops with the launch fix; stock configs and DS_ACCO=off build stock
    engines; the routes through ds_acco build ACCO engines."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(REPO / "ds_acco_autoinstall.pth", site_dir)
    prog = (f"import site, runpy, sys; site.addsitedir({str(site_dir)!r}); sys.argv = [{str(GUARD_SCRIPT)!r}, "
            f"{str(tmp_path / 'store')!r}, {str(tmp_path)!r}]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", prog], cwd=tmp_path,
                          env={**guard_env(os.environ), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=scaled(180))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_guard_run(proc.stdout, proc.stderr)


# -- the hook in this process, on a fake deepspeed ------------------------------------------------------
@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    """A ``deepspeed`` package first on sys.path that fails while ``fail`` exists next to it; yields
    the list of modules the hook's deepspeed steps ran for (the real ones are not run)."""
    root = tmp_path / "fake"
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text(
        "import os\nif os.path.exists(os.path.join(os.path.dirname(__file__), '..', 'fail')):\n"
        "    raise ImportError('fake deepspeed fails')\ndef initialize(): pass\n")
    installs = []
    real = sys.modules.pop("deepspeed", None)
    # The hook comes and goes on a copy, without the one the venv's .pth armed at start-up (an editable
    # install ships it): that one would fire on the fake deepspeed too when no test imported the real one before.
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not getattr(f, _autoinstall._MARK, False)])
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(_autoinstall, "_on_deepspeed", installs.append)
    try:
        yield root, installs
    finally:
        sys.modules.pop("deepspeed", None)
        if real is not None:
            sys.modules["deepspeed"] = real


def test_hook_stays_until_deepspeed_has_run(fake_deepspeed):
    root, installs = fake_deepspeed
    _autoinstall.activate()
    _autoinstall.activate()  # armed once
    assert sum(getattr(f, _autoinstall._MARK, False) for f in sys.meta_path) == 1
    for _ in range(3):
        spec = importlib.util.find_spec("deepspeed")
        assert Path(spec.origin).parent.parent == root and _autoinstall.armed() and installs == []
    # A probe that runs the module outside sys.modules is no import: nothing installs, the hook stays.
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert installs == [] and _autoinstall.armed()
    module = importlib.import_module("deepspeed")
    assert installs == [module] and not _autoinstall.armed()
    importlib.import_module("deepspeed")
    assert installs == [module]


def test_a_failed_import_keeps_the_hook(fake_deepspeed):
    root, installs = fake_deepspeed
    (root / "fail").write_text("")
    _autoinstall.activate()
    with pytest.raises(ImportError, match="fake deepspeed fails"):
        importlib.import_module("deepspeed")
    assert installs == [] and _autoinstall.armed()
    (root / "fail").unlink()
    module = importlib.import_module("deepspeed")
    assert installs == [module] and not _autoinstall.armed()


def test_activate_after_deepspeed_installs_at_once(fake_deepspeed):
    _, installs = fake_deepspeed
    module = importlib.import_module("deepspeed")
    _autoinstall.activate()
    assert installs == [module] and not _autoinstall.armed()


def test_a_failing_install_only_warns(monkeypatch, capsys):
    import ds_acco

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(ds_acco, "install", broken)
    _autoinstall._install()
    assert "DS_ACCO_INSTALL is set but ds_acco.install() failed: RuntimeError('boom'); running without ACCO" in \
        capsys.readouterr().err


class _Engine:
    """Stands in for DeepSpeed's engine class: the parameters the guard reads."""

    def __init__(self, args=None, model=None, config=None, config_class=None):
        self.built = True


@pytest.mark.parametrize("install", ["", "1"])
def test_deepspeed_steps_guard_engines_then_install(monkeypatch, install):
    """Right after deepspeed has run: its engine class is guarded (once), then ds_acco.install() only
    with DS_ACCO_INSTALL set; a stock engine from an enabled block raises before it builds anything."""
    installs = []
    engine_class = type("DeepSpeedEngine", (_Engine,), {"__init__": _Engine.__init__})
    module = types.SimpleNamespace(runtime=types.SimpleNamespace(engine=types.SimpleNamespace(
        DeepSpeedEngine=engine_class)))
    monkeypatch.setenv("DS_ACCO_INSTALL", install)
    monkeypatch.delenv("DS_ACCO", raising=False)
    monkeypatch.setattr(_autoinstall, "_install", lambda: installs.append(True))
    _autoinstall._on_deepspeed(module)
    _autoinstall._on_deepspeed(module)
    assert installs == [True, True][:2 * bool(install)]
    assert engine_class.__init__.__wrapped__ is _Engine.__init__  # wrapped once
    assert engine_class(config={"zero_optimization": {"stage": 1}}).built
    assert engine_class(config={"acco": {"enabled": False}}).built
    config_class = types.SimpleNamespace(_param_dict={"acco": {"enabled": True}})
    with pytest.raises(RuntimeError, match="engine being built is a stock DeepSpeedEngine.*fix: launch the script "
                                           "through ds_acco"):
        engine_class(None, None, config_class=config_class)
    monkeypatch.setenv("DS_ACCO", "off")
    assert engine_class(None, None, config_class=config_class).built


def test_a_failing_guard_only_warns(capsys):
    _autoinstall._on_deepspeed(types.SimpleNamespace())  # no runtime.engine: not DeepSpeed as we know it
    assert "watching DeepSpeed engines for an enabled \"acco\" block failed" in capsys.readouterr().err
