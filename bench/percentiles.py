"""Percentiles for the benches, apart from any script with heavy imports (gateway_rest imports grpc, which
the GPU host's wheels may not match: adapter_loading.py failed to start there)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1): the smallest value with at least q of them at or below it.
    (Indexing at int(q * n) read one rank high: the p99 of 100 samples was their maximum.)"""
    data = sorted(values)
    if not data:
        return float("nan")
    rank = math.ceil(q * len(data) - 1e-9)  # the tolerance keeps 0.07 * 100 = 7.000000000000001 at rank 7
    return data[min(len(data), max(rank, 1)) - 1]
