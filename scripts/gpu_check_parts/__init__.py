"""The parts of scripts/gpu_check.py, one module each: the named checks they share (checks), the
stream protocol (protocol), the profiler trace (trace), precision, FSDP2 and tensor parallelism
against the float64 reference (precision), peak memory (memory), and the GPT the trace and memory
parts train (gpt_runs). The list of checks and the command line are scripts/gpu_check.py's; it puts
the suite's harness and workers on ``sys.path``, which the parts' lazy imports of them need."""
