"""tests/prebuild.py's stale-lock rule: torch's JIT build lock (a file its builder keeps open) is
removed when no process has it open, and left alone while one does."""
import os
import subprocess
import sys
import time

import prebuild

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build


def _lock(root, op):
    os.makedirs(root / op)
    path = root / op / "lock"
    return path


def test_lock_of_a_killed_build_is_removed(tmp_path):
    path = _lock(tmp_path, "deepspeed_shm_comm")
    # what torch's FileBaton does, in a process that is then killed before release()
    code = f"import os, signal; os.open({str(path)!r}, os.O_CREAT | os.O_EXCL); os.kill(os.getpid(), signal.SIGKILL)"
    subprocess.run([sys.executable, "-c", code])
    assert path.exists()
    assert prebuild.clear_stale_locks(str(tmp_path), log=lambda *_: None) == [str(path)]
    assert not path.exists()


def test_lock_of_a_running_build_is_kept(tmp_path):
    path = _lock(tmp_path, "fused_adam")
    code = (f"import os, sys, time; os.open({str(path)!r}, os.O_CREAT | os.O_EXCL); print('held', flush=True); "
            "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holders, _ = prebuild.lock_holders(str(path))
        assert holder.pid in holders
        assert prebuild.clear_stale_locks(str(tmp_path), log=lambda *_: None) == []
        assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    assert prebuild.clear_stale_locks(str(tmp_path), log=lambda *_: None) == [str(path)]


def test_an_old_lock_is_removed_even_if_some_processes_cannot_be_inspected(tmp_path, monkeypatch):
    path = _lock(tmp_path, "cpu_adam")
    path.touch()
    monkeypatch.setattr(prebuild, "lock_holders", lambda p: (set(), False))  # e.g. other users' processes
    assert prebuild.clear_stale_locks(str(tmp_path), log=lambda *_: None) == []  # recent: left alone
    old = time.time() - prebuild.STALE_AFTER_S - 1
    os.utime(path, (old, old))
    assert prebuild.clear_stale_locks(str(tmp_path), log=lambda *_: None) == [str(path)]
