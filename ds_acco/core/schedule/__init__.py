"""The schedule: the state machine that decides when a phase ends, swaps the buffers and launches
the next round (``machine``), its position as one immutable value (``position``) and what each
phase end does, one row per mode and phase (``transitions``); with the parts it holds -- the phase
policies (``phases``), its options (``options``), the round in flight (``inflight``), drains that
agree across ranks (``drains``), the committed weights put into the model (``committed``), the
in-flight state of checkpoints (``state``) and the compute clock (``compute_clock``). Built on the
round room.
"""
