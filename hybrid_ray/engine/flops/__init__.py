"""Flops of a training step: torch's flop counter per module, the engine's profiler, the report.

    counter.py    FlopsCapture and LatencyTimer: flops, parameters and latency per module
    profiler.py   StepProfiler: the config's one report, and silent profiles for a Speedometer
    report.py     the profile as text
"""
