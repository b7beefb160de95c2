"""TP=1 (2 ranks, DP 2) vs TP=2 (4 ranks, DP 2): same init and data; stock and ACCO."""
import json, statistics, sys
sys.path.insert(0, ".")
from parse_logs import parse
R = {k: parse(f"logs/{k}.log") for k in ("stock40", "acco40", "tp1_stock40", "tp1_acco40", "tp1v_stock40", "tp1v_acco40")}
def L(k, i): return float(R[k]["iters"][i]["lm_loss"])
print("| iteration | stock TP1 | stock TP2 | ACCO TP1 | ACCO TP2 | ACCO vs stock, TP1 | ACCO vs stock, TP2 |")
print("|---|---|---|---|---|---|---|")
for i in (1, 2, 3, 5, 10, 15, 20, 25, 30, 35, 40):
    print(f"| {i} | {R['tp1_stock40']['iters'][i]['lm_loss']} | {R['stock40']['iters'][i]['lm_loss']} | "
          f"{R['tp1_acco40']['iters'][i]['lm_loss']} | {R['acco40']['iters'][i]['lm_loss']} | "
          f"{100*(L('tp1_acco40',i)/L('tp1_stock40',i)-1):+.4f}% | {100*(L('acco40',i)/L('stock40',i)-1):+.4f}% |")
m = {k: statistics.mean(L(k, i) for i in range(31, 41)) for k in R}
print(f"\nmean 31-40: stock TP1 {m['tp1_stock40']:.6f} TP2 {m['stock40']:.6f}; ACCO TP1 {m['tp1_acco40']:.6f} TP2 {m['acco40']:.6f}")
print(f"ACCO vs stock mean 31-40: TP1 {100*(m['tp1_acco40']/m['tp1_stock40']-1):+.4f}%  TP2 {100*(m['acco40']/m['stock40']-1):+.4f}%")
print(f"TP2 vs TP1 mean 31-40: stock {100*(m['stock40']/m['tp1_stock40']-1):+.4f}%  ACCO {100*(m['acco40']/m['tp1_acco40']-1):+.4f}%")
mx = {k: max(abs(L(k2, i)/L(k1, i)-1) for i in range(1, 41)) for k, (k1, k2) in
      {"stock": ("tp1_stock40", "stock40"), "acco": ("tp1_acco40", "acco40")}.items()}
print("max |TP2/TP1-1| over iterations 1-40:", {k: f"{100*v:.4f}%" for k, v in mx.items()})
print("\nvalidation:")
for j, lab in enumerate(x[0] for x in R["stock40"]["val"]):
    v = {k: float(R[k]["val"][j][1]) for k in R}
    print(f"| {lab} | stock TP1 {R['tp1_stock40']['val'][j][1]} TP2 {R['stock40']['val'][j][1]} | ACCO TP1 {R['tp1_acco40']['val'][j][1]} "
          f"TP2 {R['acco40']['val'][j][1]} | ACCO/stock TP1 {100*(v['tp1_acco40']/v['tp1_stock40']-1):+.4f}% TP2 {100*(v['acco40']/v['stock40']-1):+.4f}% |")
