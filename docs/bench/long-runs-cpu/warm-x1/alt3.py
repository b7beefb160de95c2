"""Issue 43: extra variants on a committed size record; stock is carried from that record (the simulator is
deterministic and a variant's run does not depend on what it is stacked with).
usage (from the repository root): PYTHONPATH=. python docs/bench/long-runs-cpu/warm-x1/alt3.py OUT MODEL LR_MULT SEED VARIANT [VARIANT ...]
(run at b36ce2e as /work/exp45/alt3.py, which also registered la2+warm and la1.5+warm, the same definitions as
benchmarks/multirun.py has since that commit)."""
import json, sys, time
import torch
torch.set_num_threads(1)
from benchmarks import long_runs, multirun
out, model, lr_mult, seed, variants = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
s = long_runs.setting("size", lr_mult, model=model)
src = f"size-{model}-s{seed}-x{lr_mult:g}.json"
base = json.load(open(f"docs/bench/long-runs-cpu/{src}"))
assert base["setting"] == json.loads(json.dumps(vars(s))), (base["setting"], vars(s))
stock = [r for r in base["runs"] if r["variant"] == "stock"]
assert len(stock) == 1 and stock[0]["seed"] == seed
t0 = time.time()
recs = multirun.run_group(s, [(v, seed) for v in variants], "cpu",
                          log=lambda m: print(f"{time.time()-t0:.0f}s {m}", flush=True))
json.dump({"kind": "size", "device": "cpu", "torch": torch.__version__, "params": base["params"], "setting": vars(s),
           "wall_s": time.time() - t0, "stock_from": src, "runs": stock + recs}, open(out, "w"))
print("done", time.time() - t0, flush=True)
