"""An ACCO engine's checkpoints: DeepSpeed's own save and load, around ACCO's drain, committed
weights and in-flight state."""
from __future__ import annotations

import os

from deepspeed import comm as ds_dist
from deepspeed.utils import logger

from ..core.lifecycle import publish


def save(engine, stock_save, save_dir, tag=None, client_state=None, save_latest=True,
         exclude_frozen_parameters=False) -> bool:
    """``engine.save_checkpoint``: DeepSpeed's save (``stock_save``), drained first, with the
    committed θ as the model weights and ACCO's in-flight state beside the optimizer state,
    published atomically (see core/lifecycle/publish.py)."""
    driver = engine._acco_driver()
    driver.drain()  # may book a commit: the tag then names the step it contains
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    final = os.path.join(save_dir, tag)
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    if rank == 0:
        publish.clear_scratch(final)
    with engine.acco_committed_weights():
        stock_save(save_dir, tag=os.path.basename(publish.scratch_path(final)),
                   client_state={} if client_state is None else client_state, save_latest=False,
                   exclude_frozen_parameters=exclude_frozen_parameters)
    if rank == 0:
        publish.publish(final, os.path.join(save_dir, "latest") if save_latest else None, tag)
    ds_dist.barrier()
    return True


def load(engine, stock_load, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint``: DeepSpeed's load (``stock_load``); then ACCO's in-flight state is
    restored when the checkpoint has it for this world size, otherwise a fresh phase starts at the
    loaded (committed) weights."""
    engine._acco_leave_committed_weights(settle=True)  # DeepSpeed's load writes the flat live weights
    driver = engine._acco_driver()
    driver.drain_for_load()  # an LR scheduler step still owed is taken by the caller's next step()
    schedule = driver.schedule
    engine.optimizer.pending_acco_state = None
    out = stock_load(load_dir, tag=tag, **kwargs)
    if out[0] is None:
        return out
    state = engine.optimizer.pending_acco_state
    engine.optimizer.pending_acco_state = None
    restored = False
    if state is not None:
        try:
            schedule.load_state_dict(state)
            restored = True
            # What get_global_grad_norm() answers until the next commit (HF logs it each step).
            engine._global_grad_norm = engine.optimizer._global_grad_norm = schedule.last_commit_grad_norm
        except ValueError as exc:
            logger.warning(f"{exc}; starting a fresh ACCO phase at the loaded weights")
    if not restored:
        schedule.reset(engine.global_steps)
        if engine.global_rank == 0:
            logger.info("ACCO: no usable in-flight state in the checkpoint (stock ZeRO-1 checkpoint, other "
                        "world size, or optimizer states not loaded): starting a fresh phase")
    return out
