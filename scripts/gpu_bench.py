"""The prepared GPU benchmark: one GPU, three parts, under 10 minutes, every number written as it comes.

    bash scripts/gpu_bench.sh [OUT]                   # on the GPU machine (wheels and time limit: the .sh)
    python scripts/gpu_bench.py --cpu --tiny --out OUT    # dry run: CPU, gloo, tiny models, ~1 minute

Parts, in the order they run (each one's budget is in PLANS; past a budget a part stops early and
says so in its ``limits``):
  gpu_check   scripts/gpu_check.sh through its command line (``--cpu``: its CPU dry run, with the
              recording accelerator), under a reduced time limit; its checks and exit status
  step_time   single-GPU step time (optimizer step included) of stock ZeRO-1 and ACCO fixed at GPT-2
              small (12 x 768) and medium (24 x 1024) sizes, bf16, world size 1 with NCCL (ACCO's
              optimizer step runs on the lane's stream behind the next step's compute), through the real
              DeepSpeed engine (gpu_check's ``gpt_engine``); 3 repeats, order rotated, medians
  fidelity    the fidelity sweep's stacked simulator (benchmarks/multirun.py) at GPT-2-small scale
              (12 x 768, 12 heads; the byte vocabulary makes it 85M parameters, not 124M): 3 seeds x
              stock / paper / la2 (the default estimate), 512-byte sequences of the standard library's
              source, 300 steps, bf16 autocast over fp32 weights and AdamW (DeepSpeed's bf16: bf16
              compute, fp32 master); gradient accumulation sized from a timed calibration to fit

Writes OUT/gpu_bench.json (rewritten after every part) and OUT/gpu_bench.md (the tables), and
OUT/gpu_check/ (gpu_check's own files). Exit status 1 when a part is missing, empty, skipped or
failed (:func:`problems` names each).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.monotonic()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PARTS = ("gpu_check", "step_time", "fidelity")
FIDELITY_VARIANTS = ("stock", "paper", "la2")
SEEDS = 3
REPEATS = 3
STEP_VARIANTS = ("stock", "fixed")
PLANS = {  # the GPU plan: about 9 of the 10 minutes (gpu_check took 53 s on an H200)
    "gpu": {"total_s": 560, "gpu_check_s": 150, "step_time_s": 170,
            "step_time": {"sizes": {"gpt2-small": (12, 768), "gpt2-medium": (24, 1024)}, "seq": 512,
                          "micro_batch": 8, "gas": 8, "warmup": 2, "steps": 4},
            "fidelity": {"n_embd": 768, "n_layer": 12, "n_head": 12, "seq_len": 512, "micro_batch": 2, "gas": 8,
                         "steps": 300, "warmup": 15, "lr": 6e-4, "eval_every": 50, "eval_batches": 4},
            "min_steps": 300, "calibration_steps": (2, 5)},
    "tiny": {"total_s": 300, "gpu_check_s": 120, "step_time_s": 150,  # loose: the dry run is for coverage
             "step_time": {"sizes": {"tiny-a": (1, 32), "tiny-b": (2, 64)}, "seq": 32, "micro_batch": 2, "gas": 2,
                           "warmup": 1, "steps": 2},
             "fidelity": {"n_embd": 32, "n_layer": 1, "n_head": 2, "seq_len": 32, "micro_batch": 2, "gas": 2,
                          "steps": 6, "warmup": 2, "lr": 1e-3, "eval_every": 3, "eval_batches": 1},
             "min_steps": 6, "calibration_steps": (2, 3)},
}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# -- (a) gpu_check, through its command line ----------------------------------------------------
def run_gpu_check(out_dir: str, plan: dict, args: list) -> dict:
    """``bash scripts/gpu_check.sh OUT/gpu_check`` with the plan's time limit; its JSON's checks."""
    where = os.path.join(out_dir, "gpu_check")
    env = dict(os.environ, GPU_CHECK_TIMEOUT_S=str(plan["gpu_check_s"]))
    t0 = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(HERE, "gpu_check.sh"), where, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    with open(os.path.join(where, "gpu_check.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    try:
        with open(os.path.join(where, "gpu_check.json")) as f:
            got = json.load(f)
    except (OSError, ValueError) as exc:
        return {"error": f"no gpu_check.json ({exc}); exit {proc.returncode}; log: {proc.stderr[-2000:]}"}
    checks = got.get("checks", {})
    return {"rc": proc.returncode, "wall_s": wall, "device": got.get("device"), "checks": len(checks),
            "passed": sum(1 for c in checks.values() if c["ok"]), "failed": got.get("failed", []),
            "dry_run": "--cpu" in args, "skipped": [p for p, v in got.items() if isinstance(v, str) and v.startswith("skipped")],
            "parts_s": {k[:-2]: v for k, v in got.items() if k.endswith("_s") and k != "wall_s"}}


# -- (c) step time through the real DeepSpeed engine ---------------------------------------------
def time_variant(variant: str, n_layer: int, n_embd: int, cfg: dict) -> dict:
    """One engine of ``variant`` (gpu_check's ``gpt_engine``): its median optimizer-step time."""
    from deepspeed.accelerator import get_accelerator
    from scripts.gpu_check_parts.gpt_runs import gpt_data, gpt_engine, gpt_micro_batch  # gpu_check's engine
    acc = get_accelerator()
    gc.collect()
    engine = gpt_engine(variant, n_layer, n_embd, cfg["seq"], cfg["micro_batch"], cfg["gas"])
    data = gpt_data(engine, cfg["micro_batch"], cfg["seq"], cfg["gas"])  # one optimizer step's, reused
    times = []
    for k in range(cfg["warmup"] + cfg["steps"]):
        acc.synchronize()  # timing only, between optimizer steps
        t0 = time.perf_counter()
        for rows in data:
            gpt_micro_batch(engine, rows)
        acc.synchronize()
        if k >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in engine.module.parameters())
    engine.destroy()
    del engine, data
    gc.collect()
    acc.empty_cache()
    return {"variant": variant, "params": params, "step_s": times, "median_s": statistics.median(times)}


def run_step_time(plan: dict, save) -> dict:
    """Each size: REPEATS rounds of stock and ACCO fixed, the order rotated each round; medians."""
    cfg = plan["step_time"]
    out = {"config": {k: v for k, v in cfg.items() if k != "sizes"}, "dtype": "bf16", "world_size": 1,
           "sizes": {}, "limits": []}
    t0 = time.monotonic()
    for size, (n_layer, n_embd) in cfg["sizes"].items():
        rec = out["sizes"][size] = {"n_layer": n_layer, "n_embd": n_embd, "n_head": max(1, n_embd // 64),
                                    "order": [], **{v: {"repeats_s": []} for v in STEP_VARIANTS}}
        for r in range(REPEATS):
            if time.monotonic() - t0 > plan["step_time_s"]:
                out["limits"].append(f"{size}: budget {plan['step_time_s']} s spent after {r} of {REPEATS} repeats")
                break
            order = STEP_VARIANTS[r % 2:] + STEP_VARIANTS[:r % 2]
            for variant in order:
                m = time_variant(variant, n_layer, n_embd, cfg)
                rec["params"] = m["params"]
                rec[variant]["repeats_s"].append(m["median_s"])
                rec["order"].append(variant)
                print(f"step_time {size} {variant}: {m['median_s'] * 1e3:.1f} ms", flush=True)
        for variant in STEP_VARIANTS:
            reps = rec[variant]["repeats_s"]
            rec[variant]["median_s"] = statistics.median(reps) if reps else None
        if rec["stock"]["median_s"] and rec["fixed"]["median_s"]:
            rec["speedup"] = rec["stock"]["median_s"] / rec["fixed"]["median_s"]
        save()
    return out


# -- (b) the fidelity sweep at GPT-2-small scale -------------------------------------------------
def fidelity_setting(plan: dict, **override):
    from benchmarks import multirun
    kw = dict(plan["fidelity"], **override)
    return multirun.Setting(**kw, corpus="stdlib-source", bf16=True)


def calibrate(plan: dict, device: str) -> dict:
    """Seconds per step of ONE run at the plan's size (two short runs' difference: model building,
    data and the evaluation cancel); the stacked group of R runs is budgeted at R times it."""
    from benchmarks import multirun
    k1, k2 = plan["calibration_steps"]
    walls = []
    for k in (k1, k2):
        s = fidelity_setting(plan, steps=k, warmup=1, eval_every=k, eval_batches=1)
        t0 = time.monotonic()
        multirun.run_group(s, [("paper", 0)], device)
        walls.append(time.monotonic() - t0)
    return {"steps": [k1, k2], "wall_s": walls, "step_s_one_run": max(walls[1] - walls[0], 1e-6) / (k2 - k1)}


def out_of_memory() -> tuple:
    """The exceptions of running out of device (or host) memory."""
    import torch
    return (torch.OutOfMemoryError, MemoryError)


def memory_bytes(plan: dict, gas: int, runs: int) -> float:
    """Device memory a stacked group needs, roughly: 12 fp32 copies of every run's weights (θ, θ̃, m,
    v, the Stack's own, two half-batch gradients, their pooled mean, first-half point, next θ, next θ̃,
    slack) and one half-batch's saved activations (~44 bytes per token, layer and width under bf16
    autocast: fp32 residual stream and LayerNorms, bf16 projections, 4x-wide MLP)."""
    f = plan["fidelity"]
    s = fidelity_setting(plan)
    half_tokens = s.world * gas // 2 * f["micro_batch"] * f["seq_len"]
    return runs * (12 * 4 * params_of(s) + half_tokens * f["n_layer"] * f["n_embd"] * 44)


def choose(plan: dict, per_step: float, budget_s: float, runs: int, device: str = "cpu") -> dict:
    """The largest gradient accumulation (gas, gas/2, ... >= 2) whose steps fit ``budget_s`` at
    ``runs`` x ``per_step`` (scaled with gas) and whose group fits 85% of the device's memory; if
    even gas 2 does not fit the time, fewer steps."""
    import torch
    f = plan["fidelity"]
    gas, limits = f["gas"], []
    total = torch.cuda.mem_get_info()[1] if device == "cuda" else math.inf
    while True:
        predicted = per_step * gas / f["gas"] * runs * f["steps"] * 1.15  # 15%: evaluations, slack
        if predicted <= budget_s and memory_bytes(plan, gas, runs) <= 0.85 * total or gas <= 2:
            break
        gas //= 2
    steps = f["steps"]
    if gas != f["gas"]:
        limits.append(f"gradient accumulation {gas}, not {f['gas']}: {f['gas']} was predicted past the time "
                      f"budget or 85% of the device's memory")
    if predicted > budget_s:
        steps = max(plan["min_steps"] // 2, int(steps * budget_s / predicted) // 10 * 10 or steps)
        limits.append(f"{steps} steps, not {f['steps']}: predicted {predicted:.0f} s > budget {budget_s:.0f} s")
        predicted *= steps / f["steps"]
    return {"gas": gas, "steps": steps, "warmup": max(2, steps // 20), "predicted_s": predicted,
            "budget_s": budget_s, "limits": limits}


def run_fidelity(plan: dict, device: str, deadline: float) -> dict:
    """Calibrate, choose the gradient accumulation that fits until ``deadline`` (monotonic), run the
    group; out of device memory, once more at half the accumulation if the time allows."""
    from dataclasses import asdict
    from benchmarks import multirun
    runs = [(v, seed) for seed in range(SEEDS) for v in FIDELITY_VARIANTS]
    cal = calibrate(plan, device)
    pick = choose(plan, cal["step_s_one_run"], deadline - time.monotonic(), len(runs), device)
    while True:
        s = fidelity_setting(plan, gas=pick["gas"], steps=pick["steps"], warmup=pick["warmup"])
        t0 = time.monotonic()
        try:
            recs = multirun.run_group(s, runs, device, log=lambda line: print("fidelity", line, flush=True))
            break
        except out_of_memory() as exc:
            if pick["gas"] <= 2 or time.monotonic() - t0 > (deadline - t0) / 3:
                raise
            pick["limits"].append(f"out of memory at gas {pick['gas']} ({str(exc)[:120]}); again at {pick['gas'] // 2}")
            pick["gas"] //= 2
            gc.collect()
    return {"setting": asdict(s), "params": params_of(s), "calibration": cal, "plan": pick, "limits": pick["limits"],
            "precision": "bf16 autocast (forward, backward); fp32 weights, gradients and AdamW",
            "tokens_per_step": s.world * s.gas * s.micro_batch * s.seq_len,
            "group": {"size": f"{s.n_layer}x{s.n_embd}", "lr_mult": s.lr / 1e-3, "steps": s.steps, "beta2": s.beta2,
                      "wall_s": time.monotonic() - t0, "runs": recs}}


def params_of(s) -> int:
    """Parameters of the reference GPT at ``s``'s size (byte vocabulary, tied head)."""
    d, L = s.n_embd, s.n_layer
    return 256 * d + s.seq_len * d + L * (12 * d * d + 13 * d) + 2 * d


# -- the record ----------------------------------------------------------------------------------
def problems(results: dict) -> list:
    """What makes the record incomplete: a part missing, empty, skipped, raised or failed, or a
    number that is not one. Empty when every part holds numbers."""
    out = []
    parts = results.get("parts", {})
    for part in PARTS:
        got = parts.get(part)
        if not isinstance(got, dict) or not got:
            out.append(f"{part}: missing or empty ({got!r:.80})")
        elif "error" in got:
            out.append(f"{part}: raised: {str(got['error']).strip().splitlines()[-1]}")
    gc_ = parts.get("gpu_check") or {}
    if isinstance(gc_, dict) and "error" not in gc_ and gc_:
        if not gc_.get("checks") or gc_.get("failed") or gc_.get("rc") != 0 or gc_.get("skipped") and not gc_["dry_run"]:
            out.append(f"gpu_check: {gc_.get('passed')} of {gc_.get('checks')} checks passed, failed "
                       f"{gc_.get('failed')}, skipped {gc_.get('skipped')}, exit {gc_.get('rc')}")
    st = parts.get("step_time") or {}
    if isinstance(st, dict) and "error" not in st and st:
        if len(st.get("sizes", {})) != 2:
            out.append(f"step_time: {len(st.get('sizes', {}))} sizes, not 2")
        for size, rec in st.get("sizes", {}).items():
            for v in STEP_VARIANTS:
                reps = rec.get(v, {}).get("repeats_s", [])
                if len(reps) != REPEATS or not all(finite(x) and x > 0 for x in reps):
                    out.append(f"step_time {size} {v}: repeats {reps}, not {REPEATS} positive times")
            if not finite(rec.get("speedup")):
                out.append(f"step_time {size}: no speedup")
    fd = parts.get("fidelity") or {}
    if isinstance(fd, dict) and "error" not in fd and fd:
        runs = fd.get("group", {}).get("runs", [])
        want = {(v, s) for s in range(SEEDS) for v in FIDELITY_VARIANTS}
        if {(r["variant"], r["seed"]) for r in runs} != want:
            out.append(f"fidelity: runs {sorted((r['variant'], r['seed']) for r in runs)}, not {sorted(want)}")
        for r in runs:
            if not finite(r.get("tail_mean")) or not r.get("heldout"):
                out.append(f"fidelity {r['variant']} seed {r['seed']}: no held-out loss")
            if r["variant"] != "stock" and not finite(r.get("lag_median")):
                out.append(f"fidelity {r['variant']} seed {r['seed']}: no drift")
    return out


def markdown(results: dict) -> str:
    from benchmarks.fidelity_sweep import table
    p = results.get("parts", {})
    lines = [f"# gpu_bench on {results.get('device')}", "",
             f"torch {results.get('torch')}, deepspeed {results.get('deepspeed')}, "
             f"{results.get('wall_s', 0):.0f} s in all.", ""]
    g = p.get("gpu_check") or {}
    lines += ["## gpu_check", ""]
    if "checks" in g:
        lines += ["| checks | passed | failed | exit | wall (s) |", "|---|---|---|---|---|",
                  f"| {g['checks']} | {g['passed']} | {', '.join(g['failed']) or '-'} | {g['rc']} | {g['wall_s']:.1f} |"]
    else:
        lines.append(f"not done: {g.get('error', 'not run')}")
    st = p.get("step_time") or {}
    lines += ["", "## Step time: stock ZeRO-1 vs ACCO fixed (bf16, world size 1)", ""]
    if st.get("sizes"):
        c = st["config"]
        lines += [f"micro-batch {c['micro_batch']} x {c['seq']} tokens, gas {c['gas']}; median of {REPEATS} "
                  f"repeats (order rotated), each the median of {c['steps']} steps after {c['warmup']}.", "",
                  "| size | params | stock (ms) | ACCO fixed (ms) | stock / ACCO |", "|---|---|---|---|---|"]
        for size, rec in st["sizes"].items():
            ms = [f"{rec[v]['median_s'] * 1e3:.1f}" if rec[v].get("median_s") else "-" for v in STEP_VARIANTS]
            sp = f"{rec['speedup']:.3f}" if "speedup" in rec else "-"
            lines.append(f"| {size} ({rec['n_layer']}x{rec['n_embd']}) | {rec.get('params', 0) / 1e6:.1f}M | "
                         f"{ms[0]} | {ms[1]} | {sp} |")
    else:
        lines.append(f"not done: {st.get('error', 'not run')}")
    fd = p.get("fidelity") or {}
    lines += ["", "## Fidelity at GPT-2-small scale (stacked simulator)", ""]
    if fd.get("group"):
        s = fd["setting"]
        lines += [f"{fd['params'] / 1e6:.1f}M parameters ({s['n_layer']}x{s['n_embd']}, {s['n_head']} heads), "
                  f"{s['seq_len']}-byte sequences of `{s['corpus']}`, {fd['tokens_per_step']} tokens per step "
                  f"(world {s['world']} x gas {s['gas']} x {s['micro_batch']}), {s['steps']} steps, LR {s['lr']:g}, "
                  f"{fd['precision']}. Gap of each variant's tail held-out loss to stock's, per paired seed:", "",
                  table({"groups": [fd["group"]]}, variants=[v for v in FIDELITY_VARIANTS if v != "stock"])]
    else:
        lines.append(f"not done: {fd.get('error', 'not run')}")
    limits = [f"{part}: {x}" for part in PARTS for x in (p.get(part) or {}).get("limits", [])]
    bad = problems(results)
    lines += ["", "## Limits and problems", ""] + [f"- {x}" for x in limits + bad or ["none"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_bench_out")
    ap.add_argument("--cpu", action="store_true", help="CPU and gloo (with --tiny: the dry run)")
    ap.add_argument("--tiny", action="store_true", help="tiny models, few steps")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    a = ap.parse_args(argv)
    if a.cpu and not a.tiny:
        ap.error("--cpu at GPT-2 sizes would take hours; fix: add --tiny for the dry run")
    parts = [x for x in a.parts.split(",") if x]
    if set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; use some of {','.join(PARTS)}")
    os.environ["DS_ACCELERATOR"] = "cpu" if a.cpu else "cuda"  # before benchmarks.multirun sets its default
    plan = PLANS["tiny" if a.tiny else "gpu"]
    os.makedirs(a.out, exist_ok=True)
    import torch
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device here; fix: run on the GPU machine, or pass --cpu --tiny for the dry run")
    torch.backends.cuda.matmul.allow_tf32 = False  # as the fidelity sweep
    import deepspeed
    device = "cpu" if a.cpu else "cuda"
    results = {"device": torch.cuda.get_device_name(0) if not a.cpu else "cpu (dry run)", "torch": torch.__version__,
               "deepspeed": deepspeed.__version__, "argv": sys.argv[1:], "plan": "tiny" if a.tiny else "gpu",
               "parts": {}}

    def save():
        results["wall_s"] = time.monotonic() - STARTED
        with open(os.path.join(a.out, "gpu_bench.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(a.out, "gpu_bench.md"), "w") as f:
            f.write(markdown(results))

    store_dir = tempfile.mkdtemp(prefix="gpu_bench_")
    for part in (x for x in PARTS if x in parts):
        t0 = time.monotonic()
        try:
            if part == "gpu_check":
                results["parts"][part] = run_gpu_check(a.out, plan, ["--cpu"] if a.cpu else [])
            elif part == "step_time":
                from gpu_check import init_process_group
                import torch.distributed as dist
                if not dist.is_initialized():
                    init_process_group(a.cpu, store_dir)
                results["parts"][part] = run_step_time(plan, save)
            else:
                results["parts"][part] = run_fidelity(plan, device, STARTED + plan["total_s"])
        except Exception:  # noqa: BLE001 -- recorded as this part's; the other parts still run
            import traceback
            results["parts"][part] = {"error": traceback.format_exc()}
        results["parts"][part]["part_s"] = time.monotonic() - t0
        print(f"gpu_bench: {part} done in {time.monotonic() - t0:.0f} s", flush=True)
        save()
    shutil.rmtree(store_dir, ignore_errors=True)
    bad = [x for x in problems(results) if x.split(":")[0].split()[0] in parts]
    for x in bad:
        print(f"FAIL {x}", file=sys.stderr, flush=True)
    print(json.dumps({"wall_s": round(results["wall_s"], 1), "problems": len(bad)}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
