"""Benchmarks that run jdr and its reference in one process and print the ratio.

`python -m jdr.bench NAME`; the last line of output is one JSON object with at least `jdr`,
`reference`, `ratio` (higher is better for jdr) and `units`.
"""
