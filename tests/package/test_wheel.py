"""What the installed package needs ships with it (the ready configs, ``ds_acco.configs``), and only
that: the benchmarks, the demo model and corpus (``benchmarks/``), tests and examples stay in the checkout.

The end-to-end test builds a wheel of this checkout, installs it with ``--no-deps`` into a fresh
venv outside the repository (the dependencies come from this interpreter's site-packages through
a ``.pth`` file, so nothing is downloaded), and from a directory outside the repository runs
``python -m ds_acco check`` on a shipped config by name, the moved ``ab`` command (exit 2, naming
``python -m benchmarks ab``) and ``DS_ACCO_INSTALL=1`` through the installed ``.pth`` (a deepspeed probe, then the import).
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from ds_acco import cli, configs
from dist import TORCHRUN_RENDEZVOUS, communicate, launch
from test_autoinstall import GUARD_SCRIPT, STOCK, check_guard_run, guard_env
from timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {"acco.json", "acco_bf16.json", "acco_dynamic.json", "acco_fp16.json", "acco_shared.json", "dpu.json",
           "zero1.json"}


# -- in this interpreter (fast) ------------------------------------------------------------------------
def test_shipped_configs_are_found_by_name():
    assert set(configs.names()) == SHIPPED
    assert configs.path("acco") == configs.path("acco.json") == os.path.join(configs.FOLDER, "acco.json")
    assert configs.resolve("dpu.json") == configs.path("dpu")
    with pytest.raises(FileNotFoundError, match="zero1.json"):  # the message lists what exists
        configs.path("nope.json")
    with pytest.raises(FileNotFoundError):
        configs.path("../setup.py")


def test_a_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acco.json").write_text("{}")
    assert configs.resolve("acco.json") == "acco.json"
    with pytest.raises(FileNotFoundError, match="no such file"):
        configs.resolve(str(tmp_path / "missing" / "acco.json"))  # a path is never looked up by name


def test_check_takes_a_shipped_name():
    out, err = io.StringIO(), io.StringIO()
    assert cli.check("dpu.json", out=out, err=err) == 0, err.getvalue()
    assert json.loads(out.getvalue())["acco"]["mode"] == "dpu"
    assert configs.path("dpu.json") in err.getvalue()  # says which file it checked


def test_configs_command_prints_paths(capsys):
    assert cli.main(["configs"]) == 0
    assert capsys.readouterr().out.split() == [configs.path(n) for n in sorted(SHIPPED)]
    assert cli.main(["configs", "nope"]) == 2


# -- a wheel in a fresh venv ---------------------------------------------------------------------------
def _wheel_tooling() -> str:
    """Why a wheel cannot be built here, or '' when it can."""
    if importlib.util.find_spec("pip") is None:
        return "pip is not installed"
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed"
    from importlib.metadata import version  # not `import setuptools`: after distutils it refuses to load
    found = version("setuptools")
    if tuple(int(x) for x in found.split(".")[:2]) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {found} needs the 'wheel' package to build wheels"  # bdist_wheel joined setuptools in 70.1
    return ""


def _run(argv, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=scaled(60), **kw)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _inside(path, folder) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))  # venv/bin/python is a link: no realpath


def _fresh_venv(venv: Path, wheel: Path) -> tuple:
    """``wheel`` installed with ``--no-deps`` into a new venv at ``venv``, whose dependencies (torch, deepspeed,
    transformers...) come from this interpreter, not the checkout: (its python, an env, a work dir beside it)."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel])
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "ds_acco_test_deps.pth").write_text("".join(p + "\n" for p in sorted(ours)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(DS_ACCELERATOR="cpu", PYTHONNOUSERSITE="1")
    work = venv.parent / "work"
    work.mkdir()
    return py, env, work


@pytest.mark.slow
@pytest.mark.skipif(bool(_wheel_tooling()), reason=_wheel_tooling() or "ok")
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    assert not _inside(tmp_path, REPO)
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".cache", ".pytest_cache", "bench_results",
        "runs", "docs"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist,
          src])
    (wheel,) = dist.glob("ds_acco-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"ds_acco/configs/{n}" for n in SHIPPED} <= set(names)
    assert "ds_acco/testing/recording.py" in names  # the test double ships: downstream checks may use it
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "tests", "examples", "scripts", "ds_configs",
                                                        "docs")]

    venv = tmp_path / "venv"
    py, env, work = _fresh_venv(venv, wheel)
    where = _run([py, "-c", "import ds_acco, ds_acco.configs; print(ds_acco.__file__); print(ds_acco.configs.FOLDER)"],
                 cwd=work, env=env).stdout.split()
    assert all(_inside(p, venv) for p in where), where  # the wheel, not the checkout

    check = _run([py, "-m", "ds_acco", "check", "acco.json"], cwd=work, env=env)
    assert json.loads(check.stdout)["acco"]["enabled"] is True
    assert str(Path(where[1]) / "acco.json") in check.stderr  # names the shipped file it checked

    listed = _run([py, "-m", "ds_acco", "configs"], cwd=work, env=env).stdout.split()
    assert {Path(p).name for p in listed} == SHIPPED and all(_inside(p, venv) for p in listed)

    # The instruments stayed in the checkout: the old command says where they went, and nothing installed them.
    moved = subprocess.run([py, "-m", "ds_acco", "ab", "--dry-run"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=scaled(60))
    assert moved.returncode == 2 and "python -m benchmarks ab" in moved.stderr, moved.stderr[-2000:]
    gone = subprocess.run([py, "-c", "import benchmarks"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=scaled(60))
    assert gone.returncode != 0 and "No module named 'benchmarks'" in gone.stderr, gone.stderr[-2000:]

    # DS_ACCO_INSTALL=1 through the installed .pth: start-up loads only the hook (no torch), and a probe
    # like transformers' (find_spec before the import) leaves it armed for the import that follows.
    auto = _run([py, "-c", "import importlib.util, json, sys; a = sys.modules['ds_acco._autoinstall']; "
                 "heavy = sorted(m for m in ('ds_acco', 'torch', 'deepspeed') if m in sys.modules); "
                 "importlib.util.find_spec('deepspeed'); importlib.util.find_spec('deepspeed'); "
                 "from deepspeed import initialize; import ds_acco; "
                 "print('AUTO', json.dumps([heavy, a.__file__, ds_acco.installed(), "
                 "getattr(initialize, '__ds_acco_router__', False)]))"],
                cwd=work, env={**env, "DS_ACCO_INSTALL": "1"}).stdout
    heavy, hook_file, installed, routed = json.loads(auto[auto.index("AUTO ") + 5:].splitlines()[0])
    assert heavy == [] and _inside(hook_file, venv) and installed and routed, auto[-2000:]

    # The installed .pth: an enabled "acco" block never trains stock silently, whoever builds the engine.
    guard = subprocess.run([py, GUARD_SCRIPT, tmp_path / "store", work], cwd=work, env=guard_env(env),
                           capture_output=True, text=True, timeout=scaled(180))
    assert guard.returncode == 0, guard.stdout[-3000:] + guard.stderr[-3000:]
    check_guard_run(guard.stdout, guard.stderr)
    # ... under the launchers, plain (no ds_acco run, no DS_ACCO_INSTALL): every rank stops before training
    config = work / "acco.json"
    config.write_text(json.dumps(ACCO_ON))
    for name, out, rc in _plain_launches(py, config, work, env):
        assert rc not in (0, None), (name, out[-3000:])
        assert STOCK in out and "python -m ds_acco run SCRIPT.py" in out, (name, out[-3000:])
        assert "PLAIN_RESULT" not in out and "ACCO is on" not in out, (name, out[-3000:])


@pytest.mark.slow
@pytest.mark.skipif(bool(_wheel_tooling()), reason=_wheel_tooling() or "ok")
def test_editable_install_ships_the_guard(tmp_path):
    """``pip install -e``: setuptools' editable wheel (PEP 660) carries ds_acco_autoinstall.pth beside its own
    finder (setup.py's editable_wheel), so start-up arms the hook from the checkout's sources and an engine built
    from an enabled "acco" block without ds_acco routing it stops, as with the wheel."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".cache", ".pytest_cache", "bench_results",
        "runs", "docs", "benchmarks", "examples"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_editable({str(dist)!r})"],
         cwd=src)
    (wheel,) = dist.glob("ds_acco-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ds_acco_autoinstall.pth" in names and any(n.startswith("__editable__") for n in names), names
    assert zipfile.ZipFile(wheel).read("ds_acco_autoinstall.pth") == (REPO / "ds_acco_autoinstall.pth").read_bytes()

    py, env, work = _fresh_venv(tmp_path / "venv", wheel)

    armed = _run([py, "-c", "import sys; a = sys.modules['ds_acco._autoinstall']; "
                  "print('ARMED', a.armed(), a.__file__, 'torch' in sys.modules)"], cwd=work, env=env).stdout
    assert f"ARMED True {src / 'ds_acco' / '_autoinstall.py'} False" in armed, armed  # the editable sources
    guard = subprocess.run([py, GUARD_SCRIPT, tmp_path / "store", work], cwd=work, env=guard_env(env),
                           capture_output=True, text=True, timeout=scaled(180))
    assert guard.returncode == 0, guard.stdout[-3000:] + guard.stderr[-3000:]
    check_guard_run(guard.stdout, guard.stderr)


ACCO_ON = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "acco": {"enabled": True}}
PLAIN_SCRIPT = REPO / "tests" / "launch" / "plain_ds_script.py"


def _plain_launches(py, config, cwd, env):
    """tests/launch/plain_ds_script.py (a script that knows nothing of ds_acco) on 2 ranks under the
    deepspeed launcher and under torchrun, from the wheel's interpreter: (launcher, output, exit status)."""
    env = {**env, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(cwd / "torch_extensions"))}
    args = [str(PLAIN_SCRIPT), "--deepspeed", str(config)]

    def start(cmd):
        return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    proc, out, timed_out = launch(lambda port: start([py, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                                                      "--master_addr", "127.0.0.1", "--master_port", port, *args]),
                                  scaled(120))
    assert not timed_out, out[-3000:]
    yield "deepspeed", out, proc.returncode
    proc = start([py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", *TORCHRUN_RENDEZVOUS,
                  *args])
    out, timed_out = communicate(proc, scaled(120))
    assert not timed_out, out[-3000:]
    yield "torchrun", out, proc.returncode
