"""Benchmarks (they need a CUDA GPU): `python -m taesd_fast.apps.bench` (cli.py), one section a module (head, taehv,
taesd; the conv section is in cli.py)."""
