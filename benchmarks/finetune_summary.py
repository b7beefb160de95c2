"""Fine-tune records (their version, tag and writing) to tables: held-out loss and accuracy gaps
against stock per seed (paired runs only), the curve over training, the estimate's lag."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from typing import List, Mapping, Optional, Sequence


RECORD_TAG = "FINETUNE_RECORD"
RECORD_VERSION = 1


def median_of(rows: Sequence[Mapping], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def acco_block(ds_config) -> Optional[dict]:
    """The ``"acco"`` block of a DeepSpeed config (a path or a dict), or None."""
    if isinstance(ds_config, str):
        with open(ds_config) as f:
            ds_config = json.load(f)
    return (ds_config or {}).get("acco")


def acco_enabled(block: Optional[Mapping]) -> bool:
    """Whether an ``"acco"`` block switches ACCO on (validated by ``ds_acco.AccoConfig``)."""
    if block is None:
        return False
    from ds_acco import AccoConfig
    return AccoConfig(**block).enabled


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


# -- the table --------------------------------------------------------------------------------------
PAIRING_KEYS = ("data_hash", "pretrained_hash", "init_hash", "data_order_hash")


def gap_pct(loss: float, baseline: float) -> float:
    """The relative gap of ``loss`` over ``baseline``, in percent."""
    return 100.0 * (loss - baseline) / baseline


def check_records(records: Sequence[Mapping], baseline: str) -> None:
    """Refuse records that cannot be compared: a duplicate (variant, seed), a variant whose engine
    does not match its config (stock built from an enabled acco block or the reverse), runs with
    different settings, a seed whose runs did not start from the same checkpoint, weights and data
    order, or no baseline run."""
    seen, problems = {}, []
    for r in records:
        key = (r["variant"], r["seed"])
        if key in seen:
            problems.append(f"two records for variant {key[0]!r} seed {key[1]}")
        seen[key] = r
        wants_acco = acco_enabled(r.get("acco"))
        if wants_acco != (r["engine"] != "DeepSpeedEngine"):
            problems.append(f"variant {r['variant']!r} seed {r['seed']}: acco block {r.get('acco')} but engine "
                            f"{r['engine']} (launched without `python -m ds_acco run`?)")
    settings = {json.dumps(r.get("settings"), sort_keys=True) for r in records}
    if len(settings) > 1:
        problems.append(f"the runs used different settings: {sorted(settings)}")
    if not any(v == baseline for v, _ in seen):
        problems.append(f"no record of the baseline variant {baseline!r} (variants: {sorted({v for v, _ in seen})})")
    blocks = {}
    for (variant, seed), r in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        blocks.setdefault(variant, json.dumps(r.get("acco"), sort_keys=True))
        if blocks[variant] != json.dumps(r.get("acco"), sort_keys=True):
            problems.append(f"variant {variant!r} has different acco blocks across seeds")
        base = seen.get((baseline, seed))
        if base is not None:
            for k in PAIRING_KEYS:
                if r.get(k) != base.get(k):
                    problems.append(f"seed {seed}: variant {variant!r} has {k} {r.get(k)} but {baseline!r} "
                                    f"{base.get(k)}: the runs are not paired")
    if problems:
        raise ValueError("records cannot be compared:\n  " + "\n  ".join(problems))


def gap_table(records: Sequence[Mapping], baseline: str = "stock", metric: str = "heldout_loss") -> dict:
    """Per variant other than ``baseline``: the gap (%) of ``metric`` against the baseline run of the
    same seed, per seed, and over the seeds that have both: ``n``, ``median``, ``min``, ``max``.
    Seeds without a baseline run are left out and listed under ``unpaired``."""
    check_records(records, baseline)
    by = {(r["variant"], r["seed"]): r for r in records}
    variants = [v for v in dict.fromkeys(r["variant"] for r in records) if v != baseline]
    table = {"baseline": baseline, "metric": metric,
             "baseline_values": {s: by[(baseline, s)][metric] for v, s in sorted(by) if v == baseline},
             "variants": {}}
    for variant in variants:
        seeds = sorted(s for v, s in by if v == variant)
        per_seed = {s: gap_pct(by[(variant, s)][metric], by[(baseline, s)][metric]) for s in seeds
                    if (baseline, s) in by}
        gaps = list(per_seed.values())
        table["variants"][variant] = {
            "per_seed": per_seed, "values": {s: by[(variant, s)][metric] for s in seeds},
            "unpaired": [s for s in seeds if s not in per_seed], "n": len(gaps),
            "median": statistics.median(gaps) if gaps else None,
            "min": min(gaps) if gaps else None, "max": max(gaps) if gaps else None}
    return table


def format_table(table: Mapping) -> str:
    """Markdown: one row per seed (the baseline's value, each variant's value and gap), then the
    median and the range of each variant's gap."""
    variants = list(table["variants"])
    seeds = sorted({*table["baseline_values"], *(s for v in variants for s in table["variants"][v]["values"])})
    head = [f"{table['baseline']} {table['metric']}"] + [f"{v} (gap)" for v in variants]
    lines = ["| seed | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for s in seeds:
        cells = [_fmt(table["baseline_values"].get(s))]
        for v in variants:
            t = table["variants"][v]
            val, gap = t["values"].get(s), t["per_seed"].get(s)
            cells.append("—" if val is None else f"{val:.4f} ({'unpaired' if gap is None else f'{gap:+.2f}%'})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for label, fn in (("median gap", lambda t: _pct(t["median"])),
                      ("range", lambda t: "—" if t["n"] == 0 else f"{t['min']:+.2f}% … {t['max']:+.2f}%"),
                      ("seeds paired", lambda t: str(t["n"]))):
        lines.append(f"| {label} | | " + " | ".join(fn(table["variants"][v]) for v in variants) + " |")
    return "\n".join(lines)


def curve_table(records: Sequence[Mapping], baseline: str = "stock") -> dict:
    """Per variant, per evaluation step of the run (the Trainer's periodic evaluations, on committed
    weights): the median over the paired seeds of the held-out loss gap against the baseline. The
    Trainer's loss may be scaled (see ``loss_kwargs``), but by the same factor in both runs of a pair."""
    by = {(r["variant"], r["seed"]): {p["step"]: p["loss"] for p in r["eval_curve"]} for r in records}
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        if variant == baseline:
            continue
        gaps = {}
        for (v, seed), curve in by.items():
            base = by.get((baseline, seed))
            if v == variant and base is not None:
                for step, loss in curve.items():
                    if step in base:
                        gaps.setdefault(step, []).append(gap_pct(loss, base[step]))
        out[variant] = {step: statistics.median(g) for step, g in sorted(gaps.items())}
    return out


def format_curve(curve: Mapping) -> str:
    """Markdown of :func:`curve_table`: one row per evaluation step."""
    variants = list(curve)
    steps = sorted({s for v in variants for s in curve[v]})
    lines = ["| step | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(_pct(curve[v].get(s)) for v in variants) + " |" for s in steps]
    return "\n".join(lines)


def lag_table(records: Sequence[Mapping]) -> dict:
    """Per variant with lag metrics: the median over its seeds of each run's median drift and cosine."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        runs = [r for r in records if r["variant"] == variant and r.get("drift_median") is not None]
        if runs:
            out[variant] = {"drift": statistics.median(r["drift_median"] for r in runs),
                            "cos": median_of(runs, "cos_median"), "n": len(runs)}
    return out


def format_lag(lag: Mapping) -> str:
    """Markdown of :func:`lag_table`."""
    lines = ["| variant | drift | cos | seeds |", "|---|---|---|---|"]
    lines += [f"| {v} | {t['drift']:.3f} | {_fmt(t['cos'], 3)} | {t['n']} |" for v, t in lag.items()]
    return "\n".join(lines)


def _fmt(x, digits: int = 4):
    return "—" if x is None else f"{x:.{digits}f}"


def _pct(x):
    return "—" if x is None else f"{x:+.2f}%"


def load_records(paths: Sequence[str]) -> List[dict]:
    """The JSON records at ``paths`` (each one fine-tune)."""
    out = []
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if r.get("version") != RECORD_VERSION:
            raise ValueError(f"{p}: record version {r.get('version')}, this summarizer reads {RECORD_VERSION}")
        out.append(r)
    return out


def summarize(argv: Sequence[str]) -> dict:
    """``summarize RECORDS... [--baseline stock] [--order a,b] [--out STEM]``: print the tables (loss gap
    at the end, accuracy, the gap along the run, the estimate's lag); with ``--out``, also write
    ``STEM.md`` and ``STEM.json``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune summarize")
    p.add_argument("records", nargs="+")
    p.add_argument("--baseline", default="stock")
    p.add_argument("--order", default=None, help="comma-separated variant names: the tables' column order")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    a = p.parse_args(argv)
    records = load_records(a.records)
    if a.order:
        rank = {v: i for i, v in enumerate(a.order.split(","))}
        records.sort(key=lambda r: (rank.get(r["variant"], len(rank)), r["variant"], r["seed"]))
    loss = gap_table(records, a.baseline, "heldout_loss")
    acc = gap_table(records, a.baseline, "heldout_accuracy")
    curve = curve_table(records, a.baseline)
    lag = lag_table(records)
    text = (f"Held-out loss on committed weights at the end, gap vs {a.baseline} (positive: worse)\n\n"
            f"{format_table(loss)}\n\nHeld-out accuracy, relative change vs {a.baseline}\n\n{format_table(acc)}\n\n"
            f"Held-out loss along the run (the Trainer's evaluations), median gap vs {a.baseline} over the seeds\n\n"
            f"{format_curve(curve)}\n\n"
            "Estimate lag per variant: median over seeds of each run's median per-step drift "
            "‖θ̃_k − θ_k‖ / ‖θ_k − θ_{k-1}‖ and cosine (the estimate's update vs the commit's)\n\n"
            f"{format_lag(lag)}\n")
    print(text)
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(text)
        write_json(a.out + ".json", {"heldout_loss": loss, "heldout_accuracy": acc, "curve": curve, "lag": lag})
    return loss
