"""Benchmarks and evaluation scripts, each run as `python evals/<script>.py`; a package only so that they
import their shared helpers (process_group) as `evals.*` whatever else is installed."""
