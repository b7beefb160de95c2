"""Issue 43 item 1, the LR x2 miss on 4.81M (seeds 0-1): la1.5 and la2 with stock's schedule through the LR
warm-up (la2+warm), the size setting of benchmarks.long_runs (stdlib-source, 300 steps). Stock of the same
seed is not re-run: the simulator is deterministic, so the stock run of the committed record
docs/bench/long-runs-cpu/size-5m-s{seed}-x2.json (same setting, checked) is carried into this file."""
import json, sys, time
import torch
torch.set_num_threads(1)
from benchmarks import long_runs, multirun
multirun.VARIANTS["la2+warm"] = multirun.Variant("la2+warm", lr_scale=2.0, warm=-1)
out, seed = sys.argv[1], int(sys.argv[2])
s = long_runs.setting("size", 2.0)
base = json.load(open(f"/work/main/docs/bench/long-runs-cpu/size-5m-s{seed}-x2.json"))
assert base["setting"] == json.loads(json.dumps(vars(s))), (base["setting"], vars(s))
stock = [r for r in base["runs"] if r["variant"] == "stock"]
assert len(stock) == 1 and stock[0]["seed"] == seed
t0 = time.time()
recs = multirun.run_group(s, [(v, seed) for v in ("la1.5", "la2+warm")], "cpu",
                          log=lambda m: print(f"{time.time()-t0:.0f}s {m}", flush=True))
json.dump({"kind": "size", "device": "cpu", "torch": torch.__version__, "params": 4812800, "setting": vars(s),
           "wall_s": time.time() - t0, "stock_from": f"size-5m-s{seed}-x2.json", "runs": stock + recs}, open(out, "w"))
print("done", time.time() - t0, flush=True)
