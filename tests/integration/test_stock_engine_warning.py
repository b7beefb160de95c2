"""After ``ds_acco.install()``, a DeepSpeed engine built stock from a config whose ``"acco"`` block is
enabled says so on rank 0 (it never trains stock silently), and nothing else changes: an ACCO
engine, a config without the block or with ``"enabled": false``, and every engine after
``uninstall()`` build without the warning."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
WARNING = "training runs WITHOUT ACCO"


@pytest.mark.slow  # a 2-rank job in fresh interpreters (~4.5 s)
def test_stock_engine_from_an_acco_config_warns(tmp_path):
    # python -S: no .pth runs, so the guard an installed ds_acco arms at start-up (which raises where
    # this module's subject, install()'s warning, is what a job without the guard gets) is absent
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]]),
           "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("DS_ACCO_INSTALL", None)
    proc = subprocess.run([sys.executable, "-S", str(REPO / "tests/launch/stock_acco_warning.py"), str(tmp_path / "store")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    cases = {}
    for block in out.split("CASE ")[1:]:
        name, _, rest = block.partition("\n")
        cases[name] = rest
    assert list(cases) == ["early_import", "direct", "routed", "stock_config", "disabled_block", "after_uninstall"]
    warned = {name: rest.count(WARNING) for name, rest in cases.items()}
    assert warned == {"early_import": 1, "direct": 1, "routed": 0, "stock_config": 0, "disabled_block": 0,
                      "after_uninstall": 0}, out[-4000:]
    # Only a warning: the stock engines are exactly what DeepSpeed builds.
    assert "ENGINE DeepSpeedEngine DeepSpeedZeroOptimizer" in cases["early_import"]
    assert "ENGINE AccoEngine AccoZeroOptimizer" in cases["routed"]
    assert "DeepSpeedEngine: training runs WITHOUT ACCO" in cases["direct"]
    assert "fix: call ds_acco.install()" in cases["direct"]
