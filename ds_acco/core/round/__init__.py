"""One communication round as plain functions: ``kinds`` (estimate or commit, and the tally of
micro-batches a buffer holds), ``buffers`` (G, B, the live weights and the shards of one parameter
group), ``rounds`` (reduce, step the shard, gather: what runs on the lane), ``report`` (what each
rank sends with a round) and ``drift`` (how far an estimate lands from its commit). Knows no
schedule: a round is given its buffers and counts and returns a ``RoundResult``.
"""
