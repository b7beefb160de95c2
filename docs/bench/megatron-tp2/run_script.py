"""What the side probes (gn_probe.py, mem_probe.py) share: run the Megatron script named in this
process's arguments as __main__, after the probe has patched what it measures.
`ds_acco run` inserts the launcher's --local_rank=K right after the probe's name: keep it, after
the script."""
import os
import runpy
import sys


def script_path():
    rest = sys.argv[1:]
    i = next((j for j, a in enumerate(rest) if a.endswith(".py")), None)
    if i is None:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT.py [ARGS...] (no .py script among {rest})")
    return rest[i], rest[:i] + rest[i + 1:]


def run(script=None):
    script, args = script_path() if script is None else (script, [])
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
