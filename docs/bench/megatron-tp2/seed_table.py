"""ACCO-vs-stock gap per seed and tensor-parallel size, and per-run s/iteration."""
import statistics, sys
sys.path.insert(0, ".")
from parse_logs import parse
pairs = {("1234", "TP2"): ("stock40", "acco40"), ("1234", "TP1"): ("tp1v_stock40", "tp1v_acco40")}
for s in ("1235", "1236"):
    pairs[(s, "TP2")] = (f"s{s}_stock40", f"s{s}_acco40")
    pairs[(s, "TP1")] = (f"s{s}_tp1v_stock40", f"s{s}_tp1v_acco40")
print("| seed | parallelism | stock lm loss @40 | ACCO @40 | rel @40 | rel mean 31-40 | stock val @40 | ACCO val @40 | rel val @40 | rel val (160-sample draw, end) |")
print("|---|---|---|---|---|---|---|---|---|---|")
agg = {}
for (seed, tp), (ks, ka) in sorted(pairs.items(), key=lambda x: (x[0][1], x[0][0]), reverse=True):
    S, A = parse(f"logs/{ks}.log"), parse(f"logs/{ka}.log")
    assert len(S["iters"]) == 40 and len(A["iters"]) == 40, (ks, ka)
    l = lambda R, i: float(R["iters"][i]["lm_loss"])
    r40 = l(A, 40) / l(S, 40) - 1
    ms, ma = statistics.mean(l(S, i) for i in range(31, 41)), statistics.mean(l(A, i) for i in range(31, 41))
    vs, va = float(S["val"][1][1]), float(A["val"][1][1])
    es, ea = float(S["val"][2][1]), float(A["val"][2][1])
    row = (r40, ma / ms - 1, va / vs - 1, ea / es - 1)
    agg.setdefault(tp, []).append(row)
    par = "TP 2 x DP 2 (4 ranks)" if tp == "TP2" else "TP 1 x DP 2 (2 ranks)"
    print(f"| {seed} | {par} | {S['iters'][40]['lm_loss']} | {A['iters'][40]['lm_loss']} | {100*row[0]:+.3f}% | {100*row[1]:+.3f}% | "
          f"{S['val'][1][1]} | {A['val'][1][1]} | {100*row[2]:+.3f}% | {100*row[3]:+.3f}% |")
print()
for tp, rows in agg.items():
    print(tp, "mean over seeds:", " ".join(f"{100*statistics.mean(c):+.3f}%" for c in zip(*rows)),
          " | max abs:", " ".join(f"{100*max(abs(x) for x in c):.3f}%" for c in zip(*rows)))
print("\n| run | s/iteration median (iterations 2-40 except 21) | mean |")
print("|---|---|---|")
for k in ("stock40", "stock40_repeat", "probe_stock", "s1235_stock40", "s1236_stock40",
          "acco40", "probe_acco", "s1235_acco40", "s1236_acco40",
          "tp1v_stock40", "s1235_tp1v_stock40", "s1236_tp1v_stock40", "tp1v_acco40", "s1235_tp1v_acco40", "s1236_tp1v_acco40"):
    ms = [v["ms"] for i, v in parse(f"logs/{k}.log")["iters"].items() if i >= 2 and i != 21]
    print(f"| {k} | {statistics.median(ms)/1e3:.3f} | {statistics.mean(ms)/1e3:.3f} |")
