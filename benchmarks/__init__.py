"""Benchmarks of unirl_lightning: see benchmarks/README.md (run one with `python -m benchmarks.<kind>.<name>`)."""
