"""The refusal table and its checks: ``refusals`` holds every combination ACCO does not run (one
row each: the key, why, the fix) and the functions that check a config, an optimizer or a
parallel layout against it; ``layout`` describes the parallel layout a run found; ``built`` is check
point 2, the one check of what an adapter built (before its driver). Reads the
step room (which optimizers have a functional step) and nothing above it.
"""
