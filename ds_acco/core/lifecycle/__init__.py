"""A run's lifecycle around the schedule: the learning-rate bookkeeping of committed and skipped
steps (``lr_bookkeeping``, ``scheduler_undo``), what the host adapter provides (``host``), the
per-step metrics (``metrics``), atomic publication of checkpoints (``publish``) and the exit
without ``destroy()`` (``at_exit``). The driver (``ds_acco.core.driver``) sits above every room.
"""
