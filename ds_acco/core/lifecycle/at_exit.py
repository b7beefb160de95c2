"""The end of a process that did not end its engines: rounds in flight finished before teardown."""
from __future__ import annotations

import atexit
import weakref

import torch.distributed as dist

from ...comm.groups import destroyable
from ...comm.lane import CommLane


def close_at_exit(ref: "weakref.ref") -> None:
    """At interpreter exit, an engine nobody destroyed: its last round is finished on every rank.

    Without this, a round still in flight on the lane's (daemon) thread is inside a gloo/NCCL
    collective while the interpreter finalises, and the C++ runtime aborts the process
    (``terminate called without an active exception``, SIGABRT): a script that ended normally
    reported failure, and a real error's exit status was lost. Every rank runs this at its exit,
    as the same script ends the same way on every rank: fixed mode waits for the round in flight
    (every rank launched it: same micro-batch counts), dynamic mode runs its drain protocol
    (``core/schedule/drains.py``: the j-th drain of every rank finishes the same rounds). Nothing is saved or
    written: the finished commit only updates this process's memory. Bounded by
    ``comm_timeout_s``; a peer already gone fails the collective at once (its sockets close),
    and then the round is dropped here with one line on stderr. Registered per driver with a weak
    reference, unregistered by ``close()`` / ``abandon()``; runs before torch's own teardown
    (atexit handlers run in reverse order of registration)."""
    import sys
    driver = ref()
    if driver is None or driver.abandoned:
        return
    try:
        driver.close()
    except BaseException as exc:  # noqa: BLE001 -- at exit: never replace the program's own outcome
        print(f"ds_acco: at exit, the communication round in flight could not be finished ({type(exc).__name__}: "
              f"{exc}); it is dropped", file=sys.stderr, flush=True)
        driver.abandon()
    finally:
        if getattr(sys, "last_type", None) is KeyboardInterrupt:
            rearm_sigint_exit()


# Drivers whose host was collected while their phases may disagree across ranks: drained at exit
# (AccoDriver.finalised). Lanes let go by abandon() that may still run a round: waited for at exit.
KEPT_FOR_EXIT: list = []
ABANDONED_LANES: "weakref.WeakSet[CommLane]" = weakref.WeakSet()


def join_abandoned_lanes() -> None:
    """At interpreter exit, after every driver's own hook: wait for the lanes :meth:`AccoDriver.abandon`
    let go to finish the rounds they still run (each bounded by its ``comm_timeout_s``).

    A lane thread still inside a gloo/NCCL collective while the interpreter finalises aborts the
    process (``terminate called without an active exception``): an engine collected by the
    garbage collector just before a script ended -- a function returned, an allocation triggered
    a collection -- did that now and then (2 of 88 runs). Its peers launched the same rounds, so
    the wait ends when the slowest of them gets there, or at once when a peer's exit fails the
    collective."""
    import sys
    for lane in list(ABANDONED_LANES):
        if lane.timed_out is not None:
            continue  # broken: its round already ran out of comm_timeout_s and was reported then
        if not lane.join_stopping(lane.timeout_s):
            print(f"ds_acco: at exit, a round of an engine collected without destroy() did not finish within "
                  f"acco.comm_timeout_s = {lane.timeout_s:g} s; exiting without it", file=sys.stderr, flush=True)


atexit.register(join_abandoned_lanes)  # at import: it runs after every driver's own hook


def rearm_sigint_exit() -> None:
    """Keep Ctrl-C's exit status (killed by SIGINT, as stock) after the drain above.

    CPython ends a program whose KeyboardInterrupt went unhandled by killing itself with SIGINT,
    but only while a flag it set at that moment is still set, and every ``exec`` / ``eval`` of a
    *string* clears it (``run_eval_code_obj``) -- e.g. a dataclass or namedtuple that torch builds
    lazily while the drain runs the FSDP2 round: the process then exited 1 instead of -2. The
    flag is set again the only way Python code can: by evaluating a string that raises
    KeyboardInterrupt."""
    try:
        exec("raise KeyboardInterrupt")  # noqa: S102 -- a constant string, for the flag it sets
    except KeyboardInterrupt:
        pass


def end_groups(context) -> None:
    """Take the rounds' process groups from ``context`` (a :class:`.rounds.RoundContext`, their only
    holder), destroy them and drop the last references, so torch ends their backend now: a gloo
    group's destructor joins its worker threads. Local, no collective.

    Why now and not at interpreter exit: a gloo worker thread that still holds a finished round's
    work drops it after the waiting thread moved on, and if that work holds the last reference to a
    tensor whose Python object Python already let go (a view, a counts table), torch then takes the
    GIL on that C++ thread to free it. When that happens as the interpreter finalises, Python 3.11
    ends the thread with ``pthread_exit`` inside a ``noexcept`` destructor and the C++ runtime aborts
    the process: ``terminate called without an active exception`` (SIGABRT) after a script that
    ended well (issue 33 item 8; torch's own account: pytorch/pytorch#190489). A group destroyed here,
    while the interpreter is whole, has no such thread left.

    Safe beside the main thread building the next engine's group: torch's registry of groups is
    plain dicts, changed key by key under the GIL. Not beside a concurrent
    ``destroy_process_group()`` of the whole world: destroy() engines before that. Groups created by
    their members alone are kept until the process ends (``comm/groups.py``)."""
    groups = [context.process_group, context.norm_group]
    context.process_group = context.norm_group = None
    while groups:
        pg = groups.pop()
        if pg is None or not dist.is_initialized() or not destroyable(pg):
            continue
        try:
            dist.destroy_process_group(pg)
        except Exception:  # already gone (the default group was destroyed first): nothing to free
            pass
        del pg  # the last reference: the group's destructor runs here (torch releases the GIL for it)
