"""``python -m benchmarks {cluster-test,ab,advise,summarize}`` (see ``--help`` of each)."""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import sys

from . import advisor, advisor_check, cluster, report, report_quality, report_sweep, runner, scale_check, scale_model
from .ab_spec import DEFAULT_CONFIG


def _add_run_args(p: argparse.ArgumentParser, *, probe_only: bool = False) -> None:
    p.add_argument("--world", type=int, default=2, help="ranks (one per emulated node)")
    p.add_argument("--rate", default=None,
                   help="link rate of every node ('1gbit', '100mbit'; default unshaped) or one per node, "
                        "comma-separated (heterogeneous links)")
    p.add_argument("--network", choices=("auto", "emulated", "loopback"), default="auto",
                   help="auto: the emulated cluster when root, loopback otherwise")
    p.add_argument("--gas", type=int, default=16, help="gradient_accumulation_steps (same for every variant)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="base DeepSpeed config, a path or the name of a "
                   "shipped one (python -m ds_acco configs); its acco block is replaced per variant (default: the "
                   "shipped zero1.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results", help="output folder")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before every rank is killed")
    p.add_argument("--prefix", default="accob", help="namespace name prefix (distinct per concurrent run)")
    p.add_argument("--subnet", type=int, default=0, help="10.250.<subnet>.0/24 inside the namespaces")
    p.add_argument("--slow-rank", type=int, default=-1, help="rank whose compute is slowed (heterogeneous run)")
    p.add_argument("--slow-factor", type=float, default=1.0, help="that rank computes this many times slower")
    p.add_argument("--slow-jitter", type=float, default=0.0, help="EMULATION: the slow rank's factor varies per "
                   "micro-batch, lognormal with this sigma and mean 1 (a straggler)")
    p.add_argument("--transient", default=None, help="EMULATION: FACTOR,FRACTION[,START]: the slow rank is FACTOR "
                   "times slower again for FRACTION of the steps from START (default 0.4), e.g. 3,0.2")
    p.add_argument("--emulate-compute-s", default=None,
                   help="accelerator emulation: seconds of waiting (no CPU) per training micro-batch's forward + "
                        "backward, one value or one per rank comma-separated; results are labelled EMULATION "
                        "(see benchmarks/emulation.py); needs --emulate-params")
    p.add_argument("--emulate-params", type=float, default=None,
                   help="accelerator emulation: parameters the rounds carry (e.g. 125e6); the loss comes from a "
                        "small GPT (--n-embd/--n-layer/--n-head), the rest is a zero-gradient bulk parameter")
    p.add_argument("--dry-run", action="store_true", help="resolve and check the configs, variants and every rank's "
                   "command; print them as JSON and launch nothing")
    if not probe_only:
        p.add_argument("--steps", type=int, default=6, help="committed steps per variant, warm-up included")
        p.add_argument("--warmup", type=int, default=1, help="first steps left out of the timings")
        p.add_argument("--variants", default="stock,fixed,dynamic,dpu", help="comma-separated, run in this order: stock, fixed, dynamic, dpu, shared (DeepSpeed) and fsdp_stock, "
                       "fsdp_fixed, fsdp_dynamic, fsdp_dpu (FSDP2); 'deepspeed', 'fsdp' or 'all' for a group; by name "
                       "only: stock_overlap (stock ZeRO-1 with overlap_comm, contiguous_gradients, --overlap-bucket)")
        p.add_argument("--overlap-bucket", type=int, default=None, dest="overlap_bucket_size",
                       help="stock_overlap: reduce_bucket_size in elements (default: n_embd squared, HF's 'auto')")
        p.add_argument("--repeat", type=int, default=1, help="run the variant list this many times (alternating)")
        p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: at the end)")
        p.add_argument("--eval-batches", type=int, default=4, help="held-out batches of 16 sequences per rank")
        p.add_argument("--dynamic-min", type=int, default=None, help="dynamic: min micro-batches per phase "
                       "(default gas/2)")
        p.add_argument("--dynamic-max", type=int, default=None, help="dynamic: max micro-batches per phase "
                       "(default 256)")
        p.add_argument("--target-loss", type=float, default=None, help="time-to-target threshold (default: "
                       "stock's final held-out loss + 1%%)")
        p.add_argument("--label", default=None, help="file name stem of this run's outputs")
        p.add_argument("--memory", action="store_true", help="peak-memory measurement: one variant, run first in "
                       "fresh processes (no warm-up run, probe after), peak RSS from before its model is built "
                       "(scripts/memory_bench.sh runs every variant this way, repeated, order rotated)")


def parse_variants(text: str) -> tuple:
    """``stock,fixed,...``; ``all`` = every variant, ``deepspeed`` / ``fsdp`` = one framework's four."""
    from .variants import DS_VARIANTS, FSDP_VARIANTS
    groups = {"all": DS_VARIANTS + FSDP_VARIANTS, "deepspeed": DS_VARIANTS, "fsdp": FSDP_VARIANTS}
    out = []
    for v in (v.strip() for v in text.split(",")):
        if v:
            out += groups.get(v, (v,))
    return tuple(out)


def _compute_s(text):
    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise SystemExit(f"--emulate-compute-s {text!r}: seconds, one value or one per rank comma-separated") from None
    return values[0] if len(values) == 1 else values


def _transient(text):
    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
        assert len(values) in (2, 3)
    except (ValueError, AssertionError):
        raise SystemExit(f"--transient {text!r}: FACTOR,FRACTION[,START], e.g. 3,0.2") from None
    return dict(zip(("factor", "fraction", "start"), values))


def _spec(a, **over) -> runner.ABSpec:
    kw = dict(world=a.world, rate=a.rate, network=a.network, gas=a.gas, micro_batch=a.micro_batch,
              seq_len=a.seq_len, n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head, base_config=a.config,
              seed=a.seed, timeout_s=a.timeout, prefix=a.prefix, subnet=a.subnet, slow_rank=a.slow_rank,
              slow_factor=a.slow_factor, slow_jitter=a.slow_jitter, transient=_transient(a.transient),
              emulate_compute_s=_compute_s(a.emulate_compute_s),
              emulate_params=None if a.emulate_params is None else int(a.emulate_params))
    for k in ("steps", "warmup", "repeat", "eval_every", "eval_batches", "dynamic_min", "dynamic_max",
              "overlap_bucket_size", "target_loss", "label", "memory"):
        if hasattr(a, k):
            kw[k] = getattr(a, k)
    if hasattr(a, "variants"):
        kw["variants"] = parse_variants(a.variants)
    kw.update(over)
    return runner.ABSpec(**kw)


def cmd_cluster_test(a) -> int:
    cluster.require_root()
    rates = a.rate.split(",") if a.rate and "," in a.rate else a.rate
    with cluster.Cluster(a.nodes, rates, prefix=a.prefix, subnet=a.subnet) as cl:
        print(f"cluster: {cl.describe()}", flush=True)
        argv = [sys.executable, "-m", "benchmarks.nettest", "--mbytes", str(a.mbytes)]
        envs = [{**cl.rank_env(r, 29400), "OMP_NUM_THREADS": "1"} for r in range(a.nodes)]
        outs = cluster.launch([cl.wrap(r, argv) for r in range(a.nodes)], envs, timeout_s=a.timeout)
    results = [json.loads(next(line for line in o.splitlines() if line.startswith("{"))) for o in outs]
    problems = [f"rank {r['rank']}: default route present ({r['default_route']})" for r in results
                if r["default_route"]] + [f"rank {r['rank']}: wrong all-reduce result" for r in results
                                          if not r["all_reduce_ok"]]
    print(json.dumps({"nodes": a.nodes, "rate": a.rate or "unshaped", "results": results, "problems": problems}))
    return 1 if problems else 0


def _json_lines(value, depth: int = 2, indent: str = "") -> str:
    """JSON with the first ``depth`` levels one entry per line and anything deeper on one line."""
    if depth == 0 or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value)
    inner = indent + " "
    items = [(f"{json.dumps(k)}: " if isinstance(value, dict) else "") + _json_lines(v, depth - 1, inner)
             for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
    open_, close = "{}" if isinstance(value, dict) else "[]"
    return open_ + "\n" + ",\n".join(inner + i for i in items) + "\n" + indent + close


def _print_plan(spec: runner.ABSpec, out_dir: str) -> int:
    print(_json_lines(runner.plan(spec, os.path.join(out_dir, f"{spec.name()}.raw.json"))))
    return 0


def cmd_ab(a) -> int:
    spec = _spec(a)
    if a.dry_run:
        return _print_plan(spec, a.out)
    summary = runner.run_ab(spec, a.out, command="python -m benchmarks " + shlex.join(sys.argv[1:]))
    return 0 if summary["variants"] else 1


def cmd_advise(a) -> int:
    spec = _spec(a, steps=1, variants=(), label=a.label or f"probe-{_spec(a).name()}")
    if a.dry_run:
        return _print_plan(spec, a.out)
    raw = runner.launch_workers(spec, os.path.join(a.out, f"{spec.name()}.raw.json"))
    tok = a.micro_batch * a.seq_len
    probe = advisor.Probe.from_measured(raw["probe"], tokens_per_micro_batch=tok, cores=os.cpu_count(),
                                        ranks_per_machine=a.world if raw["network"] != "real" else 1)
    adv = advisor.advise(probe, a.gas, max_gas=a.max_gas, batch_fixed=not a.batch_flexible,
                         one_round=a.one_round)
    print(advisor.explain(adv, probe))
    with open(os.path.join(a.out, f"{spec.name()}.advice.json"), "w") as f:
        json.dump({"probe": probe.__dict__, "advice": adv.as_dict()}, f, indent=1)
    return 0


def _summaries(patterns) -> list:
    paths = list(dict.fromkeys(p for pat in patterns for p in sorted(glob.glob(pat))))  # overlapping globs: once
    return report.load_summaries([p for p in paths if p.endswith(".json") and not p.endswith((".raw.json", ".spec.json"))])


def _write_from_summaries(a, write) -> int:
    summaries = _summaries(a.paths)
    if not summaries:
        print("no summaries found", file=sys.stderr)
        return 1
    for p in write(summaries, a.out):
        print(f"wrote {p}")
    return 0


def cmd_summarize(a) -> int:
    return _write_from_summaries(a, report.write_matrix)


def cmd_sweep(a) -> int:
    return _write_from_summaries(a, report_sweep.write_sweep)


def cmd_ttt(a) -> int:
    return _write_from_summaries(a, lambda summaries, out: report_quality.write_time_to_target(
        summaries, out, stem=a.stem, target=a.target_loss))


def cmd_fidelity(a) -> int:
    res = report_quality.tail_fidelity(_summaries(a.paths), tail=a.tail)
    text = report_quality.tail_fidelity_markdown(res)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{a.stem}.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(a.out, f"{a.stem}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


def cmd_memory_table(a) -> int:
    from benchmarks import memory_model
    summaries = _summaries(a.paths)
    if not summaries:
        print("no summaries found", file=sys.stderr)
        return 1
    text = memory_model.table(summaries, order=a.variants)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "memory.md"), "w") as f:
            f.write(text + "\n")
    return 0


def cmd_advisor_check(a) -> int:
    summaries = _summaries(a.paths)
    res = advisor_check.out_of_sample(summaries, contention=a.contention)
    if not res["rows"]:
        print("no two runs of the same setup: nothing to predict out of sample", file=sys.stderr)
        return 1

    def line(name, st):
        by = ", ".join(f"{m} {e:.1%} (signed {st['mean_error_by_mode'][m]:+.1%})"
                       for m, e in st["mean_abs_error_by_mode"].items())
        return f"{name}: {st['n']} predictions, mean |error| {st['mean_abs_error']:.1%}, max {st['max_abs_error']:.1%} ({by})"
    text = "\n".join([line("out of sample (probe of another run of the same setup)", res["out_of_sample"]),
                      line("in sample (each run's own probe), same runs", res["in_sample"])])
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "advisor_out_of_sample.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


def cmd_scale_model(a) -> int:
    if a.check:
        print(scale_check.report(scale_check.check(a.check)))
    if a.table or not a.check:
        links = ("eth100", "ib400") if a.compact else tuple(x for x in a.links.split(",") if x)
        unknown = [x for x in links if x not in scale_model.LINKS]
        if unknown:
            raise ValueError(f"--links: unknown {unknown}; known: {', '.join(scale_model.LINKS)}")
        print(scale_model.markdown(scale_model.table_rows(links, eta=a.eta, mfu=a.mfu), compact=a.compact))
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["timeline"]:  # its own parser: a traced run drawn as compute / communication lanes
        from .timeline import main as timeline_main
        return timeline_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cluster-test", help="root: build an emulated cluster, check isolation and bandwidth, "
                       "tear it down")
    c.add_argument("--nodes", type=int, default=2)
    c.add_argument("--rate", default="100mbit")
    c.add_argument("--mbytes", type=float, default=8.0, help="all-reduce size (MB) used to measure bandwidth")
    c.add_argument("--prefix", default="accot")
    c.add_argument("--subnet", type=int, default=1)
    c.add_argument("--timeout", type=float, default=120.0)
    c.set_defaults(fn=cmd_cluster_test)
    ab = sub.add_parser("ab", help="stock ZeRO-1 vs ACCO fixed vs ACCO dynamic vs DPU, with a report")
    _add_run_args(ab)
    ab.set_defaults(fn=cmd_ab)
    ad = sub.add_parser("advise", help="probe this setup, predict step times, recommend a mode and "
                        "gradient_accumulation_steps")
    _add_run_args(ad, probe_only=True)
    ad.add_argument("--max-gas", type=int, default=64, help="largest gradient_accumulation_steps to recommend")
    ad.add_argument("--batch-flexible", action="store_true",
                    help="the global batch may grow: recommend a raised gradient_accumulation_steps or dynamic "
                         "accumulation where they win on tokens/s (by default they are only reported, since a "
                         "larger batch makes less progress per token)")
    ad.add_argument("--one-round", action="store_true",
                    help="recommend the one-round mode where fixed cannot hide its rounds and one round per step "
                         "is predicted fastest (off by default: it trains measurably worse than stock, "
                         "docs/bench/ttt-one-round-auto-r1.5)")
    ad.add_argument("--label", default=None)
    ad.set_defaults(fn=cmd_advise)
    sub.add_parser("timeline", help="trace compute and communication lanes of stock ZeRO-1 and ACCO into a PNG "
                   "(see python -m benchmarks timeline --help)")
    def from_summaries(name: str, fn, help: str, paths_help: str = "summary JSON files or globs (<label>.json)"):
        """A subcommand that reads A/B summaries and writes into --out."""
        sp = sub.add_parser(name, help=help)
        sp.add_argument("paths", nargs="+", help=paths_help)
        sp.add_argument("--out", default="bench_results")
        sp.set_defaults(fn=fn)
        return sp

    from_summaries("summarize", cmd_summarize, "combine A/B summaries into one Markdown file and an advisor plot")
    from_summaries("sweep", cmd_sweep, "speedup against the communication / compute ratio, with the ideal curves "
                   "(scripts/emulation_sweep.sh)")
    ck = from_summaries("advisor-check", cmd_advisor_check, "the advisor's step-time error out of sample: each run "
                        "predicted from the probe of another run of the same setup")
    ck.add_argument("--contention", choices=advisor.CONTENTION_MODELS, default="auto",
                    help="the contention model: measured (overlapped probe), kappa (CPU share; probes stored "
                         "before the overlapped probe), auto (measured where the probe has it)")
    tt = from_summaries("ttt", cmd_ttt, "time to a target held-out loss and loss at equal wall-clock, per variant, "
                        "over repeated launches (scripts/time_to_target_emulated.sh)",
                        "summary JSON files or globs (<label>.json) of one setting")
    tt.add_argument("--target-loss", type=float, default=None, help="default: 1.01 x stock's median last held-out "
                    "loss")
    tt.add_argument("--stem", default="time_to_target", help="output file name stem")
    fi = from_summaries("fidelity", cmd_fidelity, "long-run fidelity: held-out loss at equal tokens averaged over "
                        "the last part of each run, against stock (scripts/fidelity_long.sh)")
    fi.add_argument("--tail", type=float, default=0.3, help="the last fraction of the steps averaged (default 0.3)")
    fi.add_argument("--stem", default="fidelity", help="output file name stem")
    mt = from_summaries("memory-table", cmd_memory_table, "peak memory per rank of ab --memory runs "
                        "(scripts/memory_bench.sh): medians, each variant against its stock and the README formula")
    mt.add_argument("--variants", nargs="+", default=None, help="row order (default: as found)")
    mt.set_defaults(out=None)  # print only, unless --out names a folder for memory.md
    sm = sub.add_parser("scale-model", help="predicted step times of stock, fixed and one-round at scale (on paper; "
                        "docs/bench/scale-model)")
    sm.add_argument("--table", action="store_true", help="the 1B/7B/70B x 8..1024 GPUs table (Markdown; the default)")
    sm.add_argument("--compact", action="store_true", help="BENCHMARKS.md's table (eth100 and ib400, past one node)")
    sm.add_argument("--links", default="eth100,ib400,ib400-node", help=f"comma-separated: {', '.join(scale_model.LINKS)}")
    sm.add_argument("--eta", type=float, default=scale_model.ETA_NCCL, help="achieved fraction of the line rate")
    sm.add_argument("--mfu", type=float, default=scale_model.MFU)
    sm.add_argument("--check", metavar="ROOT", nargs="?", const="docs/bench",
                    help="score the model on every emulated record under ROOT (default docs/bench)")
    sm.set_defaults(fn=cmd_scale_model)
    a = p.parse_args(argv)
    # Started in the background, a shell leaves SIGINT ignored; make SIGINT and SIGTERM unwind
    # (ranks killed, namespaces deleted) instead of dying or being ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return a.fn(a)
    except cluster.NeedsRoot as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except cluster.LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as exc:  # bad arguments (e.g. an unknown variant or config)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
