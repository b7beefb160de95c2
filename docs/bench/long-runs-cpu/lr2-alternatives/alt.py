"""Issue 43 item 1, the LR x2 miss on 4.81M: seed from argv; stock, la1.5 and la2 with stock's schedule through
the LR warm-up (la2+warm), the size setting of benchmarks.long_runs (stdlib-source, 300 steps)."""
import json, sys, time
import torch
torch.set_num_threads(1)
from benchmarks import long_runs, multirun
multirun.VARIANTS["la2+warm"] = multirun.Variant("la2+warm", lr_scale=2.0, warm=-1)
out, seed = sys.argv[1], int(sys.argv[2])
s = long_runs.setting("size", 2.0)
t0 = time.time()
recs = multirun.run_group(s, [(v, seed) for v in ("stock", "la1.5", "la2+warm")], "cpu",
                          log=lambda m: print(f"{time.time()-t0:.0f}s {m}", flush=True))
json.dump({"kind": "size", "device": "cpu", "torch": torch.__version__, "params": 4812800, "setting": vars(s),
           "wall_s": time.time() - t0, "runs": recs}, open(out, "w"))
print("done", time.time() - t0, flush=True)
