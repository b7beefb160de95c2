"""Predict step times of stock ZeRO-1, ACCO fixed, ACCO dynamic, DPU and the one-round mode from a
short probe, recommend a mode and a ``gradient_accumulation_steps`` (:mod:`.advisor_check` checks the model
against measured A/B points).

The model (times per optimizer step, ``A`` = gradient_accumulation_steps, ``t`` = compute per
micro-batch of the slowest rank):

* ``T_c = A·t``: compute.
* ``T_r``: one communication round — reduce the gradient, one sharded optimizer step,
  all-gather the parameters (taken from the probe's own measurements at this world size: on
  gloo stock ZeRO-1's per-owner reduces cost about one all-reduce, and ACCO reduces with an
  in-place all-reduce; on NCCL a reduce-scatter costs half an all-reduce) plus a few tiny
  collectives for counts and norms in ACCO's rounds.
* Contention, measured: the probe also runs rounds on a side thread while the compute lane
  keeps computing, as ACCO does, and times both: ``t'`` per micro-batch and ``T_r'`` per round
  while they overlap. On a CPU-only host the rounds' copies, reductions and shard step take
  cores from compute and compute slows the rounds (on 2 ranks × 2 cores both by up to ~2×); on
  an accelerator ``t' ≈ t`` and ``T_r' ≈ T_r``. A window of length ``T_r'`` overlapped with
  compute then holds ``T_r'/t'`` micro-batches, and the rest of a window runs at full speed:
  ``W(n) = T_r' + (n − T_r'/t')·t`` is the time of ``n`` micro-batches with one round under
  them. If the round outlasts them (``n < T_r'/t'``), compute waits after ``n·t'`` and the
  rest of the round runs alone: ``W(n) = n·t' + (1 − n·t'/T_r')·T_r``.
* stock:   ``T_c + T_r``                       (nothing overlaps)
* fixed:   ``2·W(A/2)``                        (two rounds per step, one under each half)
* shared:  ``2·W(P/t)``, ``P = max_i n_i·t_i``  (accumulation 'shared': rank i computes its share
  ``n_i`` of the ranks' ``N·A/2`` micro-batches per phase, by the training's own rule,
  ``share_by_speed``, from every rank's measured ``t_i``; at equal speeds ``P = A/2·t``, fixed's)
* dpu:     ``W(A)``                            (one round per step, one step stale)
* one_round: ``W(A)``                          (``"mode": "one_round"``: DPU's schedule and bytes,
  one commit round per step hidden behind the whole next step, so DPU's step time; its timing is
  checked against the measured DPU points)
* dynamic: each phase holds ``n = max(m, ⌈T_r'/t'⌉)`` micro-batches (``m`` the minimum) and
  lasts ``W(n)``; its figure of merit is tokens/s.

Probes stored before the overlapped measurement existed (``round_overlap_s`` 0) use the older
model: contention ``κ``, the fraction of a round's wall time that burns CPU, counted only when
the ranks have no spare core (``shared_cores``); fixed ``max(T_c + 2κ·T_r, 2·T_r)``, dpu
``max(T_c + κ·T_r, T_r)``, dynamic phases ``max(T_r, m·t + κ·T_r)`` of
``n = max(m, ⌈(1−κ)·T_r / t⌉)`` micro-batches. It leaves out that compute slows the rounds,
and predicted fixed 11–19% too fast on average (BENCHMARKS.md, advisor out of sample).

Ranks of different speeds (slowest over fastest ``t_i`` above 1.2, the share rule's dead band at 2
ranks): :func:`advise` recommends accumulation 'shared' where it is predicted faster than both
stock and fixed: it keeps stock's global batch, so it needs no batch to grow.

The rule: ACCO sends two rounds per optimizer step, so fixed mode hides them fully only when one
round fits under half a step's compute (``T_r'/t' ≤ A/2`` micro-batches beside compute),
and gains only if the contention costs less than the round it hides (:func:`advise`
recommends it only then: partly hidden rounds were predicted to gain and measured to lose);
otherwise the one-round mode, one round per step under the whole next step, is recommended where it
is predicted fastest (``margin`` ahead of stock and fixed at the same batch), with its caveat
(:data:`ONE_ROUND_CAVEAT`); a raised ``A`` or dynamic accumulation would also hide the round, with
a larger global batch that makes less progress per token, so :func:`advise` reports those and
recommends them only when the batch may grow (``batch_fixed=False``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple


@dataclasses.dataclass
class Probe:
    """What the probe measured on the user's setup (seconds; bytes)."""
    micro_batch_s: float  # compute (forward + backward) per micro-batch, slowest rank
    all_reduce_s: float  # all-reduce of the full model (communication dtype)
    all_gather_s: float  # all-gather of the full model from 1/N shards
    opt_step_s: float = 0.0  # one optimizer step on a 1/N shard
    latency_s: float = 0.0  # a tiny all-reduce
    world: int = 2
    tokens_per_micro_batch: int = 128
    comm_cpu_fraction: float = 0.0  # κ: CPU seconds burnt per wall second of communication
    shared_cores: bool = False  # the ranks' compute threads use every core (no core left for comm)
    backend: str = "gloo"
    comm_bytes: int = 0
    micro_batch_overlap_s: float = 0.0  # t': compute per micro-batch while rounds run beside it
    round_overlap_s: float = 0.0  # T_r': one round (reduce + shard step + all-gather) beside compute
    rank_micro_batch_s: Tuple[float, ...] = ()  # every rank's compute per micro-batch (heterogeneous hardware)

    @classmethod
    def from_measured(cls, probes: Sequence[dict], *, tokens_per_micro_batch: int, cores: Optional[int] = None,
                      ranks_per_machine: Optional[int] = None, backend: str = "gloo") -> "Probe":
        """Combine the worker's per-rank probe dicts (the slowest rank's compute counts)."""
        world = len(probes)
        med = lambda key: sorted(p[key] for p in probes)[len(probes) // 2]  # noqa: E731
        rpm = ranks_per_machine if ranks_per_machine is not None else world
        return cls(micro_batch_s=max(p["micro_batch_s"] for p in probes), all_reduce_s=med("all_reduce_s"),
                   all_gather_s=med("all_gather_s"), opt_step_s=med("opt_step_s"), latency_s=med("latency_s"),
                   world=world, tokens_per_micro_batch=tokens_per_micro_batch,
                   comm_cpu_fraction=min(1.0, max(0.0, med("comm_cpu_fraction") if "comm_cpu_fraction" in probes[0]
                                                 else 0.0)),
                   shared_cores=cores is not None and rpm >= cores, backend=backend,
                   comm_bytes=int(probes[0].get("comm_bytes", 0)),
                   micro_batch_overlap_s=max(p.get("micro_batch_overlap_s", 0.0) for p in probes),
                   round_overlap_s=max(p.get("round_overlap_s", 0.0) for p in probes),
                   rank_micro_batch_s=tuple(float(p["micro_batch_s"]) for p in probes))

    @property
    def speed_spread(self) -> float:
        """Slowest over fastest rank's compute per micro-batch (1: homogeneous or unknown)."""
        ts = [t for t in self.rank_micro_batch_s if t > 0]
        return max(ts) / min(ts) if len(ts) > 1 else 1.0

    def shared_phase_s(self, gas: int) -> float:
        """Accumulation 'shared': one phase's compute, the slowest of every rank's share of the
        ranks' ``world · A/2`` micro-batches times its seconds per micro-batch (phases.py's rule,
        dead band included: at equal speeds it is fixed mode's ``A/2 · t``)."""
        from ds_acco.core.schedule.phases import share_by_speed  # no torch: the rule itself, as training applies it
        ts = list(self.rank_micro_batch_s) if len(self.rank_micro_batch_s) == self.world else [self.micro_batch_s] * self.world
        equal = (gas // 2,) * self.world
        shares = share_by_speed(self.world * (gas // 2), ts, current=equal)
        return max(n * t for n, t in zip(shares, ts))

    @property
    def round_s(self) -> float:
        """One ACCO round: reduce + shard step + all-gather + ~3 tiny collectives."""
        reduce = self.all_reduce_s if self.backend == "gloo" else self.all_reduce_s / 2
        return reduce + self.opt_step_s + self.all_gather_s + 3 * self.latency_s

    @property
    def stock_comm_s(self) -> float:
        """Stock ZeRO-1's exposed communication per step (same pieces, no tiny collectives)."""
        reduce = self.all_reduce_s if self.backend == "gloo" else self.all_reduce_s / 2
        return reduce + self.opt_step_s + self.all_gather_s

    @property
    def overlap_measured(self) -> bool:
        return self.round_overlap_s > 0 and self.micro_batch_overlap_s > 0

    @property
    def round_under_compute_s(self) -> float:
        """``T_r'``: one ACCO round while compute runs beside it (+ the tiny collectives)."""
        return self.round_overlap_s + 3 * self.latency_s

    @property
    def round_span(self) -> float:
        """Micro-batches one round spans: beside compute (``T_r'/t'``) where measured, else alone."""
        if self.overlap_measured:
            return self.round_under_compute_s / self.micro_batch_overlap_s
        return self.round_s / self.micro_batch_s if self.micro_batch_s > 0 else math.inf

    @property
    def kappa(self) -> float:
        return self.comm_cpu_fraction if self.shared_cores else 0.0

    @property
    def bandwidth_gbit(self) -> Optional[float]:
        """Achieved all-reduce bus bandwidth (Gbit/s) implied by the probe."""
        if not self.comm_bytes or self.all_reduce_s <= 0:
            return None
        wire = 2 * (self.world - 1) / self.world * self.comm_bytes
        return wire * 8 / self.all_reduce_s / 1e9


@dataclasses.dataclass
class Prediction:
    """Predicted per-step figures of one mode."""
    mode: str
    step_s: float
    micro_batches_per_rank: float  # per optimizer step
    tokens_per_s: float
    compute_busy: float  # fraction of wall time the compute lane computes


CONTENTION_MODELS = ("auto", "measured", "kappa")


def predict(probe: Probe, gas: int, *, dynamic_min: Optional[int] = None,
            contention: str = "auto") -> Dict[str, Prediction]:
    """Predicted step time, micro-batches and tokens/s of each mode at ``gas``.

    ``contention``: ``measured`` uses the probe's overlapped timings (``W(n)`` of the module
    docstring), ``kappa`` the older CPU-share model, ``auto`` the first where the probe has them."""
    if contention not in CONTENTION_MODELS:
        raise ValueError(f"contention={contention!r}: use one of {', '.join(CONTENTION_MODELS)}")
    if contention == "auto":
        contention = "measured" if probe.overlap_measured else "kappa"
    if contention == "measured" and not probe.overlap_measured:
        raise ValueError("contention='measured' needs a probe with micro_batch_overlap_s and round_overlap_s "
                         "(probes stored before they existed: use contention='kappa')")
    t = probe.micro_batch_s
    tc = gas * t
    tok = probe.tokens_per_micro_batch * probe.world
    m = dynamic_min if dynamic_min is not None else max(1, gas // 2)
    out = {}

    def add(mode: str, step: float, mbs: float) -> None:
        out[mode] = Prediction(mode, step, mbs, tok * mbs / step if step > 0 else math.inf,
                               min(1.0, mbs * t / step) if step > 0 else 1.0)

    add("stock", tc + probe.stock_comm_s, gas)
    if contention == "measured":
        ro, to, under = probe.round_under_compute_s, probe.micro_batch_overlap_s, probe.round_span

        def window(n: float) -> float:  # n micro-batches with one round under them
            if n >= under:
                return ro + (n - under) * t
            return n * to + (1 - n / under) * probe.round_s  # compute waits: the rest of the round runs alone

        add("fixed", 2 * window(gas / 2), gas)
        add("shared", 2 * window(probe.shared_phase_s(gas) / t), gas)  # the phase's compute, in slowest-rank units
        add("dpu", window(gas), gas)
        add("one_round", window(gas), gas)  # DPU's schedule: one round under the whole step
        n = max(m, math.ceil(under - 1e-9))
        add("dynamic", 2 * window(n), 2 * n)
        return out
    tr, k = probe.round_s, probe.kappa
    add("fixed", max(tc + 2 * k * tr, 2 * tr), gas)
    add("shared", max(2 * probe.shared_phase_s(gas) + 2 * k * tr, 2 * tr), gas)
    add("dpu", max(tc + k * tr, tr), gas)
    add("one_round", max(tc + k * tr, tr), gas)
    n = max(m, math.ceil(max(0.0, (1 - k) * tr) / t - 1e-9)) if t > 0 else m
    phase = max(tr, n * t + k * tr)
    add("dynamic", 2 * phase, 2 * n)
    return out


@dataclasses.dataclass
class Advice:
    mode: str  # 'stock', 'fixed', 'one_round', 'shared' or 'dynamic'
    gradient_accumulation_steps: int
    predictions: Dict[str, Prediction]
    reason: str
    larger_batch: Optional[dict] = None  # what a larger global batch would buy in tokens/s (not in time)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "reason": self.reason, "larger_batch": self.larger_batch,
                "predictions": {k: dataclasses.asdict(v) for k, v in self.predictions.items()}}


SPEED_SPREAD = 0.2  # ranks' speeds differing by more than this: heterogeneous (the share rule's dead band at 2 ranks)

LARGER_BATCH_CAVEAT = ("a larger global batch makes less progress per token: in our measurements it did not reach a "
                       "target loss sooner (BENCHMARKS.md, time to target); measure it with your learning rate")


ONE_ROUND_CAVEAT = ("one-round computes every micro-batch of a step at a prediction of the parameters one step "
                    "ahead: in the fidelity simulator it trained measurably worse than stock (its best predictor, "
                    "ef, +3.61% held-out loss at LR x1, docs/bench/one-round-predictors-cpu), where fixed's two "
                    "rounds did not; measure its loss with your learning rate before adopting it")


def advise(probe: Probe, gas: int, *, max_gas: int = 64, negligible: float = 0.05, margin: float = 0.03,
           batch_fixed: bool = True, one_round: bool = False) -> Advice:
    """Recommend a mode and gradient_accumulation_steps for this setup (see the module rule).

    ``batch_fixed`` (the default): the training recipe fixes the global batch, so only stock and
    ACCO fixed at ``gas`` are recommended; what a larger batch (raised A, or dynamic
    accumulation) would buy in tokens/s is reported in ``larger_batch``, not recommended, since
    per-token progress drops with the batch. ``batch_fixed=False`` recommends those too. Fixed
    must be predicted ``margin`` faster than stock (ACCO costs a buffer; the model errs by ~10%)
    with one round fitting under half a step: where rounds are only partly hidden the model has
    been optimistic and fixed measured later than stock, so it is named, not recommended. Where
    fixed does not hide its rounds the one-round mode is recommended if predicted ``margin``
    faster than both, with :data:`ONE_ROUND_CAVEAT`, only when asked (``one_round=True``: it trains
    worse -- in the emulated time-to-target runs it had not reached stock's target after 100 steps,
    docs/bench/ttt-one-round-auto-r1.5 -- so by default it is left out, as ``"mode": "auto"`` leaves it)."""
    measured = probe.overlap_measured
    t = probe.micro_batch_s
    tr = probe.round_under_compute_s if measured else probe.round_s
    under = probe.round_span
    where = " beside compute" if measured else ""
    preds = predict(probe, gas)
    tc = gas * t
    stock, fixed, dyn = preds["stock"], preds["fixed"], preds["dynamic"]
    shared = preds["shared"]
    if probe.speed_spread > 1 + SPEED_SPREAD and shared.step_s < (1 - margin) * min(stock.step_s, fixed.step_s):
        # Ranks of different speeds: whatever the network, stock and fixed wait for the slowest rank.
        speeds = "/".join(f"{x * 1e3:.0f}" for x in probe.rank_micro_batch_s)
        return Advice("shared", gas, preds,
                      f"the ranks compute at different speeds ({speeds} ms per micro-batch, {probe.speed_spread:.2f}x "
                      f"apart): with \"accumulation\": \"shared\" each phase keeps the global {probe.world * (gas // 2)} "
                      f"micro-batches and stock's batch, the slow rank computing fewer of them; predicted "
                      f"{stock.step_s / shared.step_s:.2f}x stock and {fixed.step_s / shared.step_s:.2f}x ACCO fixed "
                      "per step (where the network, not the slow rank, sets the step, shared gains no more than fixed)")
    if probe.stock_comm_s <= negligible * tc:
        return Advice("stock", gas, preds,
                      f"communication ({probe.stock_comm_s:.3f}s/step) is under {negligible:.0%} of compute "
                      f"({tc:.3f}s): nothing worth hiding; stock ZeRO-1 saves ACCO's extra buffer"
                      + (" and, on shared cores, the CPU its overlapped rounds would steal" if probe.shared_cores
                         else ""))
    fits = under <= gas / 2
    span = (f"one round ({tr:.3f}s{where}) spans {under:.1f} micro-batches, "
            f"{'within' if fits else 'over'} the {gas / 2:g} of half a step at gradient_accumulation_steps={gas}")
    faster = fixed.step_s < (1 - margin) * stock.step_s
    if faster and fits:
        return Advice("fixed", gas, preds, f"{span}: ACCO fixed hides both rounds, predicted "
                      f"{stock.step_s / fixed.step_s:.2f}x stock at the same batch")
    one = preds["one_round"]
    if one_round and one.step_s < (1 - margin) * min(stock.step_s, fixed.step_s):
        return Advice("one_round", gas, preds, f"{span}: the one-round mode (\"mode\": \"one_round\") sends one round "
                      f"per step under the whole next step, predicted {stock.step_s / one.step_s:.2f}x stock and "
                      f"{fixed.step_s / one.step_s:.2f}x ACCO fixed at the same batch; {ONE_ROUND_CAVEAT}")
    need = max(2, 2 * math.ceil(under - 1e-9)) if t > 0 else gas  # smallest even A with A/2 >= under
    larger = None
    if gas < need <= max_gas:  # once a round fits, a larger A does not change fixed's lead (the contention stays)
        alt = predict(probe, need)
        if alt["fixed"].step_s < (1 - margin) * alt["stock"].step_s:
            gain = alt["stock"].step_s / alt["fixed"].step_s
            larger = {"mode": "fixed", "gradient_accumulation_steps": need, "speedup_vs_stock": gain,
                      "why": f"ACCO sends two rounds per step, so at A={need} each half covers one; predicted "
                             f"{gain:.2f}x stock at that A"}
    if larger is None and dyn.tokens_per_s > (1 + margin) * stock.tokens_per_s:
        gain = dyn.tokens_per_s / stock.tokens_per_s
        why = (f"fixed would need A={need} (over max_gas={max_gas})" if need > max_gas else
               "fixed loses to the rounds' contention with compute at any A")
        larger = {"mode": "dynamic", "gradient_accumulation_steps": gas, "speedup_vs_stock": gain,
                  "why": f"{why}; dynamic accumulation keeps computing while it waits: predicted {gain:.2f}x "
                         f"stock's tokens/s with ~{dyn.micro_batches_per_rank:.0f} micro-batches per rank per step "
                         "(a larger, varying batch)"}
    if larger is not None and not batch_fixed:
        mode, a = larger["mode"], larger["gradient_accumulation_steps"]
        return Advice(mode, a, predict(probe, a), f"{span}; {larger['why']}; {LARGER_BATCH_CAVEAT}", larger)
    if faster:  # partly hidden rounds: the model's optimistic side, and measured to lose (BENCHMARKS.md)
        reason = (f"{span}: ACCO fixed would hide only part of each round, predicted {stock.step_s / fixed.step_s:.2f}x "
                  "stock, but where rounds do not fit the model has been optimistic for fixed (ACCO's rounds in "
                  "training take longer than the probe's) and fixed measured later than stock on time to target; "
                  "measure it (A/B run) before adopting it")
    else:
        reason = (f"{span}: ACCO fixed is predicted {fixed.step_s / stock.step_s:.2f}x stock's step time at this "
                  "batch" + ("" if fits else " (two rounds per step outlast the compute they overlap)"))
    if preds["dpu"].step_s < (1 - margin) * stock.step_s:
        reason += (f"; DPU would be {stock.step_s / preds['dpu'].step_s:.2f}x faster per step, but it applies "
                   "one-step-stale gradients and its held-out loss lagged stock's at equal tokens (BENCHMARKS.md)")
    if larger is not None:
        reason += (f". At a larger batch: {larger['why']}; {LARGER_BATCH_CAVEAT} (advise with "
                   "--batch-flexible to recommend it)")
    return Advice("stock", gas, preds, reason, larger)


def explain(advice: Advice, probe: Probe) -> str:
    """A short human-readable report of a probe, the predictions and the advice."""
    bw = probe.bandwidth_gbit
    lines = [f"probe: {probe.micro_batch_s * 1e3:.1f} ms compute per micro-batch; one round {probe.round_s:.3f}s "
             f"(all-reduce {probe.all_reduce_s:.3f}s, all-gather {probe.all_gather_s:.3f}s, shard step "
             f"{probe.opt_step_s:.3f}s, latency {probe.latency_s * 1e6:.0f} us"
             + (f", ~{bw:.2f} Gbit/s achieved" if bw else "") + f"), world {probe.world}"
             + (f"; while both run: {probe.micro_batch_overlap_s * 1e3:.1f} ms per micro-batch, "
                f"{probe.round_under_compute_s:.3f}s per round" if probe.overlap_measured else
                f", comm CPU share {probe.comm_cpu_fraction:.2f} on shared cores" if probe.shared_cores else ""),
             f"{'mode':<8} {'step s':>8} {'mb/rank':>8} {'tokens/s':>10} {'busy':>6}"]
    for p in advice.predictions.values():
        lines.append(f"{p.mode:<8} {p.step_s:>8.3f} {p.micro_batches_per_rank:>8.1f} {p.tokens_per_s:>10.0f} "
                     f"{p.compute_busy:>6.0%}")
    lines.append(f"advice: mode {advice.mode!r}, gradient_accumulation_steps {advice.gradient_accumulation_steps}"
                 f" — {advice.reason}")
    lines.append("rule: ACCO sends two rounds per optimizer step, so fixed mode hides them only where one round "
                 "fits under half a step's compute (T_round <= A*t/2, both as they run beside each other), and gains only "
                 "where the rounds' contention with compute costs less than the rounds it hides.")
    return "\n".join(lines)
