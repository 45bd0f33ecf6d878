"""Bucket choice for captured decode graphs (the capture itself is covered by tests/gpu)."""

from __future__ import annotations

from engine.cuda_graphs import GraphKey, batch_buckets, bucket_for, kv_len_buckets


def test_batch_buckets_space_like_vllm_and_end_at_the_maximum() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]


def test_kv_len_buckets_double_from_256_and_end_at_max_len() -> None:
    assert kv_len_buckets(100) == [100]
    assert kv_len_buckets(256) == [256]
    assert kv_len_buckets(2048) == [256, 512, 1024, 2048]
    assert kv_len_buckets(600) == [256, 512, 600]


def test_bucket_for_picks_the_smallest_that_fits_or_none() -> None:
    assert bucket_for([1, 2, 4, 8], 3) == 4
    assert bucket_for([1, 2, 4, 8], 8) == 8
    assert bucket_for([1, 2, 4, 8], 9) is None


def test_graph_keys_sort_largest_first_for_capture() -> None:
    keys = sorted([GraphKey(1, 256, False), GraphKey(8, 256, True), GraphKey(8, 512, False)], reverse=True)
    assert keys == [GraphKey(8, 512, False), GraphKey(8, 256, True), GraphKey(1, 256, False)]
