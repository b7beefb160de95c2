"""DS_ACCO_INSTALL=1 with ds_acco_autoinstall.pth in site-packages: ``ds_acco.install()`` runs when
the program imports deepspeed, whatever looked deepspeed up before; unset, the line never imports
ds_acco. A temporary directory read with ``site.addsitedir`` stands for site-packages (the wheel
puts the .pth there, see setup.py; tests/package/test_wheel.py runs the installed one). The hook
itself is also tested in this process on a fake ``deepspeed`` package."""
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
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


def test_unset_costs_nothing(tmp_path):
    line, err = _python(tmp_path, "import sys; print('ds_acco' in sys.modules, 'torch' in sys.modules)")
    assert line == "False False" and "Error processing" not in err


def test_set_installs_when_deepspeed_is_imported(tmp_path):
    code = ("import sys; before = 'ds_acco' in sys.modules and sys.modules['ds_acco'].installed()\n"
            "from deepspeed import initialize\n"
            "import ds_acco\n"
            "print(before, ds_acco.installed(), getattr(initialize, '__ds_acco_router__', False))")
    line, err = _python(tmp_path, code, DS_ACCO_INSTALL="1")
    assert line == "False True True", err[-2000:]
    line, _ = _python(tmp_path, "import sys; import deepspeed; print('ds_acco' in sys.modules)", DS_ACCO_INSTALL="0")
    assert line == "False"


def test_set_loads_only_the_hook_at_start(tmp_path):
    """The .pth loads ds_acco/_autoinstall.py alone: not the package, whose __init__ imports torch."""
    line, err = _python(tmp_path, "import sys; a = sys.modules['ds_acco._autoinstall']\n"
                        "print(sorted(m for m in ('ds_acco', 'ds_acco.config', 'torch', 'deepspeed', 'pydantic') "
                        "if m in sys.modules), a.armed(), a.__file__)", DS_ACCO_INSTALL="1")
    assert line == f"[] True {REPO / 'ds_acco' / '_autoinstall.py'}", err[-2000:]


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


# -- the hook in this process, on a fake deepspeed ------------------------------------------------------
@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    """A ``deepspeed`` package first on sys.path that fails while ``fail`` exists next to it; yields
    the list of modules ``_install`` was called with (the real ds_acco.install() is not run)."""
    root = tmp_path / "fake"
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text(
        "import os\nif os.path.exists(os.path.join(os.path.dirname(__file__), '..', 'fail')):\n"
        "    raise ImportError('fake deepspeed fails')\ndef initialize(): pass\n")
    installs = []
    real = sys.modules.pop("deepspeed", None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hook comes and goes on a copy
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(_autoinstall, "_install", lambda: installs.append(sys.modules.get("deepspeed")))
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
