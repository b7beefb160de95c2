"""Mode 'one_round' at its edges, against test_one_round.py's float64 reference of the recurrence: a
skipped commit (non-finite gradient: θ and S stay, P is still predicted from them), DeepSpeed's gradient
clipping, and 4 ranks (ext's θ_{t-1} in other ranks' bytes of B at each rank's own offset; ZeRO-1's
padded segments)."""
import pytest

from dist import run_ranks
from reference import rel_distance
from test_one_round import STEPS, _ds_case, one_round_reference
import one_round_workers as orw  # noqa: E402

ADAMW = {"optimizer": "adamw", "schedule": None}
SKIP = [(1, 6)]  # rank 1, micro-batch 6: step 1's commit is skipped
SKIPPED = (1,)
CLIP = 0.02  # below every step's mean-gradient norm here (checked: the unclipped reference is far)
EDGES = [
    dict(ADAMW, name="ef-skip", predictor={"name": "ef", "coef": 0.5}, nan_at=SKIP),
    dict(ADAMW, name="ext-skip", predictor="ext", nan_at=SKIP),
    dict(ADAMW, name="nag-skip", predictor="nag", nan_at=SKIP),
    dict(ADAMW, name="ef-clip", predictor={"name": "ef", "coef": 0.5}, clip=CLIP),
]
WORLD4 = [dict(ADAMW, name=f"{p}-4-ranks", predictor=p) for p in ("ef", "ext", "nag")]


def _case(c):
    return _ds_case(c, **{k: c[k] for k in ("nan_at", "clip") if k in c})


@pytest.fixture(scope="module")
def edges():
    return run_ranks(orw.train_one_round, cases=[_case(c) for c in EDGES])


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(orw.train_one_round, world=4, cases=[_case(c) for c in WORLD4])


def _check(case, r, want, wrong):
    err = rel_distance(r["final"], want)
    far = min(rel_distance({n: v.float() for n, v in want.items()}, w) for w in wrong)
    print(f"{case['name']}: relative error {err:.2e}; to the wrong answers {far:.2e}")
    assert far > 1e-3, "the wrong answers barely move θ_T: the test could not tell them apart"
    assert err < 1e-5


@pytest.mark.parametrize("index", range(len(EDGES)), ids=[c["name"] for c in EDGES])
def test_edge_matches_reference(edges, index):
    """Skip: catches a predictor that does not see the skip (ef's buffer left holding P_t, so P jumps
    by (2+γ)·θ; ext without θ_{t-1}); also the skip not honoured (the unskipped reference) and the
    prediction dropped there (P = θ). Clip: catches the commit stepping with the unclipped mean."""
    case = EDGES[index]
    r = edges[0][index]
    skip, clip = (SKIPPED if "nan_at" in case else ()), case.get("clip", 0.0)
    want = one_round_reference(case, skip=skip, clip=clip)
    wrong = [one_round_reference(case, dropped=True, skip=skip, clip=clip)]
    wrong.append(one_round_reference(case, clip=0.0) if clip else one_round_reference(case))
    _check(case, r, want, wrong)
    assert r["skipped_steps"] == len(skip)
    for a, b in zip(edges[0][index]["final"].values(), edges[1][index]["final"].values()):
        assert (a == b).all()


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[c["name"] for c in WORLD4])
def test_four_ranks_match_reference(four_ranks, index):
    """4 ranks: every rank's segment, its own scratch offset for ext, the same θ_T on every rank."""
    case = WORLD4[index]
    want = one_round_reference(case, world=4)
    wrong = [one_round_reference(case, world=4, dropped=True), one_round_reference(case, world=4, twice=True)]
    for r in four_ranks:
        _check(case, r[index], want, wrong)
        assert r[index]["global_steps"] == STEPS
        assert all((r[index]["final"][n] == four_ranks[0][index]["final"][n]).all() for n in want)
