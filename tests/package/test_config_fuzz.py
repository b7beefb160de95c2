"""Hundreds of malformed "acco" blocks: every one is a ValueError naming the offending key and a fix."""
import json
import random

import pytest

from ds_acco.config import AccoConfig

NEEDS_DEEPSPEED_OPS = False  # no DeepSpeed engine, rank or launcher: conftest.py skips the op build

# key path -> values that must be refused there
BAD = {
    "enabled": ["true", 1, 0, None, 1.0, [], {}],
    "mode": ["ACCO", "zero1", "", 1, None, True, ["acco"]],
    "accumulation": ["Fixed", "dyn", 2, None, False],
    "weighting": ["tokens", "batch", 1, None],
    "nonfinite": ["ignore", "Skip", 0, None],
    "synchronous": ["no", 0, 1, None, 0.0],
    "comm_timeout_s": [0, -1, -0.5, "60", None, True, [60]],
    "chunk_elements": [0, 1023, -4096, "AUTO", "4096", 4096.0, None, True],
    "dynamic.min_micro_batches": [0, -3, 1.5, "2", None, True],
    "dynamic.max_micro_batches": [0, -1, 2.5, "8", True],
    "dynamic.check_every": [0, -2, 1.0, "1", None, False],
    "metrics.log_every": [-1, 1.5, "10", None, True],
    "metrics.estimate_drift": ["yes", 1, None],
    "metrics.estimate_drift_every": [0, -1, 1.5, "100", None, True],
    "metrics.monitor": ["on", 0, None],
}
VALID_KEYS = ["enabled", "mode", "accumulation", "weighting", "nonfinite", "synchronous", "comm_timeout_s",
              "chunk_elements", "dynamic", "metrics"]
NESTED_KEYS = {"dynamic": ["min_micro_batches", "max_micro_batches", "check_every"],
               "metrics": ["log_every", "estimate_drift", "estimate_drift_every", "monitor"]}


def misspell(rng, key):
    ops = [
        lambda k: k[:-1],
        lambda k: k + "s",
        lambda k: k.upper(),
        lambda k: k.replace("_", "-") if "_" in k else k + "_",
        lambda k: k[1:] + k[0],
        lambda k: k[: len(k) // 2] + k[len(k) // 2 + 1:],
    ]
    out = rng.choice(ops)(key)
    return out if out != key else key + "x"


def build(path, value, dynamic=True):
    block = {"enabled": True}
    if path.startswith("dynamic.") or dynamic and path == "accumulation":
        block["accumulation"] = "dynamic"
    parts = path.split(".")
    target = block
    for p in parts[:-1]:
        target = target.setdefault(p, {})
    target[parts[-1]] = value
    return block


def canonical(case) -> str:
    """One string per distinct (block, expected key): JSON with sorted keys (1, 1.0, True, "1" differ)."""
    return json.dumps(case, sort_keys=True)


def cases(n=400, seed=1234):
    """``n`` distinct malformed blocks (the random draws repeat themselves: 400 draws held 261
    distinct cases, so draws are deduplicated until there are ``n``)."""
    rng = random.Random(seed)
    seen = set()

    class _Distinct(list):  # a list whose append drops repeats
        def append(self, case):
            key = canonical(case)
            if key not in seen:
                seen.add(key)
                super().append(case)

    out = _Distinct()
    for path, values in BAD.items():  # every bad value of every key
        for v in values:
            out.append((build(path, v, dynamic=False), path))
    draws = 0
    while len(out) < n:
        draws += 1
        if draws > 100 * n:
            raise RuntimeError(f"only {len(out)} distinct cases after {draws} draws: widen the generator")
        kind = rng.random()
        if kind < 0.4:  # a misspelt key, top level or nested
            if rng.random() < 0.5:
                key = misspell(rng, rng.choice(VALID_KEYS))
                block = {"enabled": True, key: rng.choice([True, 1, "x", {}])}
                out.append((block, key))
            else:
                parent = rng.choice(list(NESTED_KEYS))
                key = misspell(rng, rng.choice(NESTED_KEYS[parent]))
                block = {"enabled": True, parent: {key: 1}}
                if parent == "dynamic":
                    block["accumulation"] = "dynamic"
                out.append((block, f"{parent}.{key}"))
        elif kind < 0.8:  # a bad value mixed into an otherwise valid block
            path = rng.choice(list(BAD))
            block = build(path, rng.choice(BAD[path]))
            block.setdefault("mode", rng.choice(["acco", "dpu"]))
            out.append((block, path))
        else:  # incompatible combinations
            lo = rng.randint(2, 9)
            if rng.random() < 0.5:
                block = {"enabled": True, "accumulation": "dynamic",
                         "dynamic": {"min_micro_batches": lo, "max_micro_batches": rng.randint(1, lo - 1)}}
                out.append((block, "dynamic.max_micro_batches"))
            else:
                block = {"enabled": True, "accumulation": "fixed", "dynamic": {"min_micro_batches": lo}}
                out.append((block, "dynamic"))
    return list(out)


CASES = cases()


def test_there_are_hundreds_of_distinct_cases():
    distinct = {canonical(c) for c in CASES}
    print(f"{len(CASES)} cases, {len(distinct)} distinct")
    assert len(distinct) == len(CASES) >= 400


@pytest.mark.parametrize("i", range(len(CASES)))
def test_malformed_block_is_refused_with_key_and_fix(i):
    block, key = CASES[i]
    with pytest.raises(ValueError) as info:
        AccoConfig.from_block(block)
    msg = str(info.value)
    assert f"acco.{key}" in msg, f"{block}: {msg}"
    assert "fix" in msg, msg
