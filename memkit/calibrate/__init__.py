"""Calibration harnesses: memkit's estimates checked against measurements -- published GPU runs
(published_memory.py: peak memory; published_throughput.py: step time and plan ranking) and
training steps measured here (cpu_step.py: one CPU process; deepspeed_step.py: DeepSpeed on CPU;
parallel_step.py: tp / pp / dp splits under torchrun, the harness behind launch/parallel_train.py).
Used by benchmarks/, launch/ and the tests; the layer above train/, below cli/
(memkit/ARCHITECTURE.md)."""
