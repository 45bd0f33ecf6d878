"""Benchmarks: scripts run as files (`PYTHONPATH=. python3 bench/NAME.py`), importing each other's helpers."""
