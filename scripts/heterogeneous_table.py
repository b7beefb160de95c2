"""The heterogeneous sweep's summary table (EMULATION): one row per slow factor, each variant's time
to target against stock (median [range] over repeats, ratios within each repeat) and its held-out
loss at stock's tokens against stock's, from the per-factor outputs of ``python -m benchmarks ttt``.

    python scripts/heterogeneous_table.py docs/bench/heterogeneous/ttt-slow*/ttt-*slow1x*[0-9].json
"""
import json
import re
import sys

VARIANTS = ("fixed", "shared", "dynamic")


def main(paths):
    rows = []
    for path in paths:
        m = re.search(r"slow\d+x([\d.]+)\.json$", path)
        if not m:
            continue
        ratio = re.search(r"-r([\d.]+)-", path)
        res = json.load(open(path))
        by = {r["variant"]: r for r in res["rows"]}
        stock = by["stock"]
        cells = [ratio.group(1) if ratio else "–", f"{float(m.group(1)):g}×", f"{stock['step_s']:.3f}"]
        for v in VARIANTS:
            r = by.get(v)
            if r is None:
                cells.append("–")
                continue
            lo, hi = r["vs_stock_range"] or (None, None)
            ttt = f"**{r['vs_stock']:.2f}×** [{lo:.2f}–{hi:.2f}]" if r["vs_stock"] else "not reached"
            gap = (r["loss_at_equal_tokens"] / stock["loss_at_equal_tokens"] - 1) * 100
            cells.append(f"{ttt}, {gap:+.2f}%" + (f" ({r['tokens_per_step'] / stock['tokens_per_step']:.1f}× batch)"
                                                  if r["tokens_per_step"] != stock["tokens_per_step"] else ""))
        rows.append(((float(ratio.group(1)) if ratio else 0.0, float(m.group(1))), cells))
    print("| r (nominal) | slow rank | stock s per step | ACCO fixed: time to target × stock, gap at equal tokens | ACCO shared | "
          "ACCO dynamic |")
    print("|---|---|---|---|---|---|")
    for _, cells in sorted(rows):
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
