"""Table of DeepSpeed get_global_grad_norm() per step from the gn_probe side runs."""
import re, sys, collections
def load(p):
    d = collections.defaultdict(dict)
    for r, i, g in re.findall(r"GNPROBE rank (\d+) iteration (\d+) grad_norm (\S+?)(?=GNPROBE|\s|$)", open(p).read()):
        d[int(i)][int(r)] = g
    return d
s, a = load("logs/probe_stock.log"), load("logs/probe_acco.log")
print("| step() call | stock grad norm (ranks 0-3) | ACCO get_global_grad_norm() (ranks 0-3) |")
print("|---|---|---|")
for i in sorted(set(s) | set(a)):
    fs = sorted(set(s.get(i, {}).values())); fa = sorted(set(a.get(i, {}).values()))
    print(f"| {i} | {', '.join(fs)} ({len(s.get(i, {}))} ranks) | {', '.join(fa)} ({len(a.get(i, {}))} ranks) |")
