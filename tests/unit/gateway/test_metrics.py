from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.queue import TenantStats


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_requests_are_counted_by_tenant_status_and_protocol() -> None:
    metrics = GatewayMetrics()
    metrics.request_done("alice", "ok", "rest", 0.004)
    metrics.request_done("alice", "ok", "rest", 0.2)
    metrics.request_done("bob", "not_found", "rest", 0.001)
    samples = _samples(metrics)
    ok = (("protocol", "rest"), ("status", "ok"), ("tenant", "alice"))
    assert samples[("adaptergate_requests_total", ok)] == 2
    assert samples[("adaptergate_request_duration_seconds_count", ok)] == 2
    assert abs(samples[("adaptergate_request_duration_seconds_sum", ok)] - 0.204) < 1e-9
    assert samples[("adaptergate_request_duration_seconds_bucket", (("le", "0.005"), *ok))] == 1
    bob = (("protocol", "rest"), ("status", "not_found"), ("tenant", "bob"))
    assert samples[("adaptergate_requests_total", bob)] == 1


def test_queue_state_is_read_at_scrape_time() -> None:
    metrics = GatewayMetrics()
    state = {"alice": TenantStats(3, 1.5, 120, 2, 64, 1)}
    metrics.observe_queue(lambda: state)
    metrics.observe_engines(lambda: {"engine-0": True, "engine-1": False})
    samples = _samples(metrics)
    alice = (("tenant", "alice"),)
    assert samples[("adaptergate_queue_depth", alice)] == 3
    assert samples[("adaptergate_queue_oldest_wait_seconds", alice)] == 1.5
    assert samples[("adaptergate_served_tokens_total", alice)] == 120
    assert samples[("adaptergate_in_flight_requests", alice)] == 2
    assert samples[("adaptergate_queue_rejected_total", alice)] == 1
    assert samples[("adaptergate_engine_healthy", (("replica", "engine-1"),))] == 0
    state["alice"] = TenantStats(0, 0.0, 200, 0, 0, 1)
    assert _samples(metrics)[("adaptergate_queue_depth", alice)] == 0


def test_engine_figures_are_read_at_scrape_time() -> None:
    metrics = GatewayMetrics()
    figures = {
        "engine-0": {
            "running_requests": 3,
            "waiting_requests": 1,
            "kv_slots_used": 3,
            "slot_hits": 40,
            "slot_misses": 5,
            "evictions": 2,
            "loads": 6,
            "fills_ahead": 4,
        }
    }
    metrics.observe_engine_stats(lambda: figures)
    samples = _samples(metrics)
    replica = (("replica", "engine-0"),)
    assert samples[("adaptergate_engine_running_requests", replica)] == 3
    assert samples[("adaptergate_engine_kv_slots_used", replica)] == 3
    assert samples[("adaptergate_engine_adapter_slot_hits_total", replica)] == 40
    assert samples[("adaptergate_engine_adapter_slot_misses_total", replica)] == 5
    assert samples[("adaptergate_engine_adapter_evictions_total", replica)] == 2
    assert samples[("adaptergate_engine_adapter_loads_total", replica)] == 6
    assert samples[("adaptergate_engine_adapter_fills_ahead_total", replica)] == 4
    figures["engine-0"] = {**figures["engine-0"], "slot_hits": 41}
    assert _samples(metrics)[("adaptergate_engine_adapter_slot_hits_total", replica)] == 41


def test_two_instances_do_not_share_registries() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.request_done("a", "ok", "rest", 0.1)
    assert b'tenant="a"' in first.render()
    assert b'tenant="a"' not in second.render()
