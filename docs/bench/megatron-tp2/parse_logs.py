"""Parse Megatron-DeepSpeed logs (logs/*.log) and print the stock-vs-ACCO and resume comparisons.

usage: python parse_logs.py LOGDIR OUT.json"""
import json, os, re, statistics, sys

IT = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|(.*)")
FIELD = re.compile(r"\s*([^|:]+?):\s*([^|]+?)\s*\|")
VAL = re.compile(r"validation loss at (.+?) \| lm loss value: (\S+) \|")


def parse(path):
    its, vals = {}, []
    if not os.path.exists(path):
        return None
    for line in open(path, errors="replace"):
        m = IT.search(line)
        if m and "lm loss:" in line:
            f = dict((k.strip(), v.strip()) for k, v in FIELD.findall(m.group(3)))
            its[int(m.group(1))] = {"lm_loss": f.get("lm loss"), "ms": float(f["elapsed time per iteration (ms)"]),
                                    "lr": f.get("learning rate"), "grad_norm": f.get("grad norm"),
                                    "skipped": f.get("number of skipped iterations")}
        m = VAL.search(line)
        if m:
            vals.append((m.group(1), m.group(2)))
    return {"iters": its, "val": vals}


def rel(a, b):
    return (float(a) - float(b)) / float(b)


def timing(its, first=2, skip=()):
    ms = [v["ms"] for k, v in sorted(its.items()) if k >= first and k not in skip]
    return {"n": len(ms), "mean_s": statistics.mean(ms) / 1e3, "median_s": statistics.median(ms) / 1e3} if ms else None


def main(logdir, out):
    L = {n[:-4]: parse(os.path.join(logdir, n)) for n in sorted(os.listdir(logdir)) if n.endswith(".log")}
    res = {"runs": L}
    s, a = L.get("stock40"), L.get("acco40")
    if s and a and s["iters"] and a["iters"]:
        rows = []
        print("| iteration | stock lm loss | ACCO lm loss | rel diff (ACCO-stock)/stock | lr stock | lr ACCO |")
        print("|---|---|---|---|---|---|")
        for i in sorted(set(s["iters"]) & set(a["iters"])):
            r = rel(a["iters"][i]["lm_loss"], s["iters"][i]["lm_loss"])
            rows.append((i, s["iters"][i]["lm_loss"], a["iters"][i]["lm_loss"], r))
            print(f"| {i} | {s['iters'][i]['lm_loss']} | {a['iters'][i]['lm_loss']} | {r*100:+.4f}% | "
                  f"{s['iters'][i]['lr']} | {a['iters'][i]['lr']} |")
        res["table"] = rows
        last = [i for i in range(31, 41) if i in s["iters"] and i in a["iters"]]
        if len(last) == 10:
            ms_ = statistics.mean(float(s["iters"][i]["lm_loss"]) for i in last)
            ma_ = statistics.mean(float(a["iters"][i]["lm_loss"]) for i in last)
            res["mean31_40"] = {"stock": ms_, "acco": ma_, "rel": (ma_ - ms_) / ms_}
            print(f"\nmean lm loss 31-40: stock {ms_:.6f}  ACCO {ma_:.6f}  rel {100*(ma_-ms_)/ms_:+.4f}%")
        if 40 in s["iters"] and 40 in a["iters"]:
            res["iter40_rel"] = rel(a["iters"][40]["lm_loss"], s["iters"][40]["lm_loss"])
            print(f"lm loss at 40: rel {100*res['iter40_rel']:+.4f}%")
        print("\nvalidation:")
        res["val"] = []
        for (ls, vs), (la, va) in zip(s["val"], a["val"]):
            r = rel(va, vs)
            res["val"].append((ls, vs, va, r))
            print(f"| {ls} | stock {vs} | ACCO {va} | {100*r:+.4f}% |")
        res["timing"] = {"stock": timing(s["iters"], skip=(21,)), "acco": timing(a["iters"], skip=(21,))}
        print("\ntiming (iterations 2-40 except 21, which includes the evaluation at 20):", res["timing"])
        print("grad norm column values (stock, ACCO):",
              {s["iters"][i]["grad_norm"] for i in s["iters"]}, {a["iters"][i]["grad_norm"] for i in a["iters"]})
    for k in ("acco", "stock"):
        full, p1, p2 = L.get(f"{k}40"), L.get(f"{k}_part1"), L.get(f"{k}_part2")
        if not (full and p1 and p2):
            continue
        same1 = [i for i in range(1, 21) if i in p1["iters"] and p1["iters"][i]["lm_loss"] == full["iters"].get(i, {}).get("lm_loss")]
        same2 = [i for i in range(21, 41) if i in p2["iters"] and p2["iters"][i]["lm_loss"] == full["iters"].get(i, {}).get("lm_loss")]
        diff2 = [(i, full["iters"].get(i, {}).get("lm_loss"), p2["iters"][i]["lm_loss"]) for i in range(21, 41)
                 if i in p2["iters"] and i not in same2]
        res[f"resume_{k}"] = {"part1_iters": sorted(p1["iters"]), "part2_iters": sorted(p2["iters"]),
                              "identical_1_20": len(same1), "identical_21_40": len(same2), "diff_21_40": diff2,
                              "val_full": full["val"], "val_part1": p1["val"], "val_part2": p2["val"]}
        print(f"\nresume {k}: part1 iterations identical to the uninterrupted run: {len(same1)}/20; "
              f"part2 (resumed) 21-40 identical: {len(same2)}/20")
        for d in diff2:
            print("   differs:", d)
        print("   val full:", full["val"], "\n   val part1:", p1["val"], "\n   val part2:", p2["val"])
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
