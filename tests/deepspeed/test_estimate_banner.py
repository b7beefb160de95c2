"""Rank 0's start-up banner says which estimate runs (issue 40, item 5): the default departs from the
paper's (docs/estimate.md), so the banner names the estimate in use and the key that gives the
paper's. Real DeepSpeed engines on 2 gloo ranks; the banner is read from DeepSpeed's logger, where
a user sees it."""
import logging

from dist import run_ranks
from timeouts import scaled

PAPER_KEY = '"estimate": "paper"'
CONFIGS = {
    "default": {"enabled": True},
    "paper": {"enabled": True, "estimate": "paper"},
    "look-ahead-1.5": {"enabled": True, "estimate": {"lr_scale": 1.5}},
    "committed-v": {"enabled": True, "estimate": {"lr_scale": 1.0, "second_moment": "committed"}},
    "dpu": {"enabled": True, "mode": "dpu"},
}


class Lines(logging.Handler):
    """Every message of the logger it is added to."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _banners(blocks):
    """Each block's banner lines as DeepSpeed's logger shows them (rank 0; [] on rank 1)."""
    from deepspeed.utils import logger

    import ds_acco
    from fixtures import TinyNet, ds_config, make_optimizer

    out = []
    for block in blocks:
        handler = Lines()
        logger.addHandler(handler)
        try:
            model = TinyNet(seed=0)
            engine, *_ = ds_acco.initialize(model=model, optimizer=make_optimizer("adamw")(model),
                                            config=ds_config(4, block))
            engine.destroy()
        finally:
            logger.removeHandler(handler)
        out.append([line for line in handler.lines if line.startswith("ACCO is on")])
    return out


def test_the_banner_names_the_estimate_in_use_and_the_papers_key():
    r0, r1 = run_ranks(_banners, blocks=list(CONFIGS.values()), timeout=scaled(120))
    assert r1 == [[]] * len(CONFIGS)  # rank 0 only
    got = {name: lines for name, lines in zip(CONFIGS, r0)}
    assert all(len(lines) == 1 for lines in got.values()), got
    tail = {name: lines[0].rsplit("; ", 1)[1] for name, lines in got.items()}
    assert tail == {
        "default": f"estimate=look-ahead lr_scale=2 (the default), the paper's: {PAPER_KEY}",
        "paper": f"estimate=the paper's ({PAPER_KEY})",
        "look-ahead-1.5": f"estimate=look-ahead lr_scale=1.5, the paper's: {PAPER_KEY}",
        "committed-v": f"estimate=variant second_moment=committed, the paper's: {PAPER_KEY}",
        "dpu": "no estimate (mode dpu)",
    }, tail
