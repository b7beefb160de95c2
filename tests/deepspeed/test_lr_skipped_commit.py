"""The learning rate under every scheduler is stock's, with skipped optimizer steps.

What stock does with a skipped step: DeepSpeed's ``_take_model_step`` steps the LR scheduler only
when the optimizer step was applied (an fp16 overflow skips both). So the reference for the LR is
the scheduler stepped once per *applied* step. Here it is a real stock engine that skips the same
steps: fp16 (DeepSpeed's dynamic loss scaler, run on CPU as tests/deepspeed/workers.py does) with a NaN
injected into one rank's micro-batch, which overflows stock's step and skips ACCO's commit of that
step (a NaN in the first half of a step skips its estimate too). Every scheduler below is compared
with stock, bit for bit:

* each optimizer step's settings (every param-group key but ``params``: ``lr``, the betas that
  OneCycleLR cycles, ...): those in the groups when stock's wrapped optimizer steps, and those
  ACCO's commit captured at its launch; ACCO's estimate of a step uses the same;
* what a caller reads after every ``step()``: stock's, except for the phase during which a skipped
  commit is in flight (ACCO stepped the scheduler at its launch, as stock does for an applied step,
  and learns of the skip when it collects the commit, half a step later);
* the scheduler's state and the groups' settings at the end.

fp32 runs (ACCO's ``nonfinite: "skip"``, its default; stock fp32 has no skip to compare with)
are compared with a fresh scheduler stepped on the applied steps.
"""
import warnings

import pytest

from dist import run_ranks
from fixtures import TinyNet, make_optimizer
from schedulers import DS_CONFIG_SCHEDULERS, SCHEDULERS, settings
from timeouts import scaled
import lr_workers

GAS, STEPS = 4, 6
NAN_AT = [(1, 6), (0, 13)]  # step 1, second half (its commit is skipped); step 3, first half (both rounds)
SKIPPED = (1, 3)
ACCO = {"enabled": True, "mode": "acco"}
KINDS = list(SCHEDULERS) + ["config:ds-warmupdecay"]
BASE = {"gas": GAS, "steps": STEPS, "nan_at": NAN_AT}
CASES = {}
for kind in KINDS:
    CASES[f"stock-{kind}"] = dict(BASE, scheduler=kind, fp16=True)
    CASES[f"acco-{kind}"] = dict(BASE, scheduler=kind, fp16=True, acco=ACCO)
CASES["dpu-sequential"] = dict(BASE, scheduler="sequential", fp16=True, acco=dict(ACCO, mode="dpu"))
FP32 = ["sequential", "config:ds-warmupdecay"]
for kind in FP32:
    CASES[f"fp32-{kind}"] = dict(BASE, scheduler=kind, acco=ACCO)
# the caller steps the scheduler before the first optimizer step: a mistake torch warns about
EARLY = {"gas": GAS, "steps": 2, "scheduler": "lambda", "scheduler_step_first": True}
CASES["early-stock"] = EARLY
CASES["early-acco"] = dict(EARLY, acco=ACCO)


@pytest.fixture(scope="module")
def runs():
    names = list(CASES)
    out = run_ranks(lr_workers.train_lr_cases, cases=[CASES[n] for n in names], timeout=scaled(300))
    return [dict(zip(names, per_rank)) for per_rank in out]


def _window(skipped, mode="acco"):
    """Micro-batches after whose step() a skipped commit is in flight: from the step() that launched
    it to the one that collects it (the next phase end)."""
    phase = GAS // 2 if mode == "acco" else GAS
    return {t * GAS + GAS - 1 + k for t in skipped for k in range(phase)}


COMPARED = [(f"acco-{k}", k, "acco") for k in KINDS] + [("dpu-sequential", "sequential", "dpu")]


@pytest.mark.parametrize("name,kind,mode", COMPARED, ids=[c[0] for c in COMPARED])
def test_every_step_uses_stocks_settings_with_skipped_steps(runs, name, kind, mode):
    for rank_runs in runs:
        stock, acco = rank_runs[f"stock-{kind}"], rank_runs[name]
        assert stock["skipped_steps"] == acco["skipped_steps"] == len(SKIPPED)  # the same steps skipped
        commits = [u for u in acco["used"] if u["kind"] == "commit"]
        assert [c["step"] for c in commits if c["skipped"]] == list(SKIPPED)
        applied = [c["settings"] for c in commits if not c["skipped"]]
        assert len(stock["used"]) == len(applied) == STEPS - len(SKIPPED)
        assert [u["step"] for u in stock["used"]] == [t for t in range(STEPS) if t not in SKIPPED]
        assert applied == [u["settings"] for u in stock["used"]]  # bit for bit, every setting of every group
        for e in (u for u in acco["used"] if u["kind"] == "estimate"):
            assert e["settings"] == next(c["settings"] for c in commits if c["step"] == e["step"])
        differ = {i for i, (a, s) in enumerate(zip(acco["read"], stock["read"])) if a != s}
        assert differ <= _window(SKIPPED, mode), sorted(differ)
        assert acco["final"] == stock["final"]
        assert acco["scheduler_state"] == stock["scheduler_state"]
        if not kind.startswith(("config:", "ds-")):  # DeepSpeed's get_last_lr() is not in its state_dict()
            assert acco["last_lr"] == stock["last_lr"]


def _fresh_reference(kind):
    """Each applied step's settings with a fresh scheduler stepped once per applied step."""
    opt = make_optimizer("adamw")(TinyNet(seed=0))
    if kind.startswith("config:"):
        from deepspeed.runtime.lr_schedules import WarmupDecayLR
        sched = WarmupDecayLR(opt, **DS_CONFIG_SCHEDULERS[kind.split(":", 1)[1]]["params"])
    else:
        sched = SCHEDULERS[kind](opt)
    used = []
    with warnings.catch_warnings():  # no optimizer step precedes these scheduler steps: torch warns
        warnings.simplefilter("ignore", UserWarning)
        for t in range(STEPS):
            if t not in SKIPPED:
                used.append(settings(opt))
                sched.step()
    return used, settings(opt)


@pytest.mark.parametrize("kind", FP32)
def test_nonfinite_skip_in_fp32_keeps_the_schedule_of_the_applied_steps(runs, kind):
    want, final = _fresh_reference(kind)
    for rank_runs in runs:
        run = rank_runs[f"fp32-{kind}"]
        assert run["skipped_steps"] == len(SKIPPED)
        applied = [u["settings"] for u in run["used"] if u["kind"] == "commit" and not u["skipped"]]
        assert applied == want
        assert run["final"] == final


def test_no_step_order_warning_under_acco(runs):
    """torch's "lr_scheduler.step() before optimizer.step()" warning: never under stock in these
    runs, and never under ACCO either, whose commits may never call optimizer.step() (the
    functional commit) and run after the scheduler steps."""
    for rank_runs in runs:
        for name, run in rank_runs.items():
            if not name.startswith("early-"):
                assert run["order_warnings"] == [], (name, run["order_warnings"])


def test_a_real_step_order_mistake_still_warns_under_acco(runs):
    for rank_runs in runs:
        stock, acco = rank_runs["early-stock"], rank_runs["early-acco"]
        assert len(stock["order_warnings"]) == 1 and "before `optimizer.step()`" in stock["order_warnings"][0]
        assert acco["order_warnings"] == stock["order_warnings"]
