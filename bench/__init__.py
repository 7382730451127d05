"""Benchmarks: each module prints a table of figures; run them with ``python -m bench.<name>``."""
