"""DS_ACCO_INSTALL=1 with ds_acco_autoinstall.pth in site-packages: ``ds_acco.install()`` runs when
the program imports deepspeed; unset, the line never imports ds_acco. A temporary directory read
with ``site.addsitedir`` stands for site-packages (the wheel puts the .pth there, see setup.py)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(tmp_path, code, **env_extra):
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(REPO / "ds_acco_autoinstall.pth", site_dir)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCO_INSTALL"}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", **env_extra)
    prog = f"import site; site.addsitedir({str(site_dir)!r})\n" + code
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120)
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
