"""Benchmarks for ds_acco: an emulated cluster, an A/B runner, an advisor, a report writer.

    python -m benchmarks cluster-test --nodes 2 --rate 100mbit   # root: check the emulated network
    python -m benchmarks ab --world 2 --rate 1gbit --gas 16       # stock vs ACCO fixed/dynamic vs DPU
    python -m benchmarks advise --gas 16                          # probe only: predict and recommend
    python -m benchmarks summarize results/*/w*.json              # combine runs (BENCHMARKS.md tables)

* :mod:`.cluster`: one network namespace per node behind a switch namespace, ``tc tbf`` links
  (root only), and a launcher that prefixes output, bounds time and ends every rank on failure.
* :mod:`.runner`: the A/B run and its bookkeeping; :mod:`.worker` is one rank of it.
* :mod:`.advisor`: the step-time model, the recommendation rule and its validation.
* :mod:`.report`: JSON, Markdown and PNG output.
Nothing here is imported by ``ds_acco`` itself.
"""
