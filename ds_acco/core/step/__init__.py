"""The optimizer step, the lowest room: one step of the caller's optimizer on this rank's shard,
kept (a commit) or discarded (an estimate). ``shard_optimizer`` runs the real ``step()`` on the
round's own settings (``RoundView``); ``functional_step`` / ``functional_kernels`` /
``functional_commit`` are the same step written as chunked functions over flat shards (no
state-sized temporaries); ``delay_compensation`` corrects the commit's first-half gradients;
``chunking`` sizes the windows every chunked pass works in. Imports nothing else of the core.
"""
