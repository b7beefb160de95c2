"""The rounds' gloo group is connected on every rank before an engine is handed back: an engine built
and destroyed at once (no round in between) must not destroy a group a slower peer is still connecting
to ("Gloo connectFullMesh failed ... Connection closed by peer", seen once under load)."""
from dist import run_ranks
from timeouts import scaled


def _barriers_at_build():
    import torch.distributed as dist

    import ds_acco
    from fixtures import TinyNet, ds_config, make_optimizer
    seen, barrier = [], dist.barrier

    def recording(*args, group=None, **kwargs):
        seen.append(group)
        return barrier(*args, group=group, **kwargs)

    dist.barrier = recording
    try:
        model = TinyNet(seed=0)
        engine, *_ = ds_acco.initialize(model=model, optimizer=make_optimizer("sgd")(model),
                                        config=ds_config(4, {"enabled": True}))
    finally:
        dist.barrier = barrier
    rounds = engine.optimizer.driver.schedule.context.process_group
    found = [g is rounds for g in seen]
    engine.destroy()  # at once: the peer is connected
    return found


def test_the_rounds_group_is_connected_everywhere_before_the_engine_is_returned():
    for found in run_ranks(_barriers_at_build, timeout=scaled(60)):
        assert found.count(True) == 1, found
