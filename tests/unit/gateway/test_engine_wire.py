"""The gateway's sampling settings through the engine's wire format and back out of the engine's gRPC service:
what a REST client asked for is what the engine samples with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import engine_pb2 as pb
from engine.errors import EngineError
from engine.sampling import SamplingParams as EngineSampling
from engine.server import EngineService
from gateway.api import GatewayRequest, SamplingParams
from gateway.engine_wire import generate_request


def _engine_side(sampling: SamplingParams) -> EngineSampling:
    wire = pb.GenerateRequest.FromString(
        generate_request(GatewayRequest("r", "t", None, prompt="x", sampling=sampling), "").SerializeToString()
    )
    engine = SimpleNamespace(max_model_len=64, config=SimpleNamespace(default_max_tokens=16))
    return EngineService(engine)._sampling(wire.sampling, 3)  # type: ignore[arg-type]


def test_logit_processing_settings_reach_the_engine() -> None:
    sent = SamplingParams(
        max_tokens=9,
        presence_penalty=-1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.25,
        logit_bias=((50256, -100.0), (3, 0.5)),
        min_p=0.25,
        min_tokens=4,
    )
    got = _engine_side(sent)
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (-1.5, 0.5, 1.25)
    assert got.logit_bias == ((3, 0.5), (50256, -100.0))  # ordered by id
    assert (got.min_p, got.min_tokens, got.max_tokens) == (0.25, 4, 9)
    got.validate(vocab_size=50257)


def test_defaults_are_the_engines_no_ops() -> None:
    got = _engine_side(SamplingParams())
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty, got.logit_bias) == (0, 0, 1, ())
    assert (got.min_p, got.min_tokens) == (0, 0)
    # A wire message without the field (a client of the engine's gRPC API that never heard of it) means 1.
    engine = SimpleNamespace(max_model_len=64, config=SimpleNamespace(default_max_tokens=16))
    assert EngineService(engine)._sampling(pb.SamplingParams(), 3).repetition_penalty == 1.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repetition_penalty"):
        EngineService(engine)._sampling(pb.SamplingParams(repetition_penalty=0.0), 3).validate()  # type: ignore[arg-type]


def test_the_engines_cache_salt_is_the_tenant_and_the_clients_salt() -> None:
    def salt(tenant: str, client_salt: str | None) -> str:
        request = GatewayRequest("r", tenant, None, prompt="x", cache_salt=client_salt)
        return pb.GenerateRequest.FromString(generate_request(request, "").SerializeToString()).cache_salt

    salts = [salt("alice", None), salt("bob", None), salt("alice", "s"), salt("alice", ""), salt('alice", "s', None)]
    assert len(set(salts)) == len(salts)  # tenants never share, nor do a tenant's salts, whatever their text
    assert salt("alice", "s") == salt("alice", "s")


def test_stop_options_reach_the_engine() -> None:
    sent = SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=(7, 2, 7), include_stop_str_in_output=True)
    got = _engine_side(sent)
    assert (got.ignore_eos, got.stop_token_ids, got.include_stop_str_in_output) == (True, (7, 2, 7), True)
    got.validate(vocab_size=8)
    with pytest.raises(ValueError, match=r"token_id\(s\) \[7\] in stop_token_ids contain out-of-vocab token ids"):
        got.validate(vocab_size=7)
    off = _engine_side(SamplingParams())
    assert (off.ignore_eos, off.stop_token_ids, off.include_stop_str_in_output) == (False, (), False)


def test_prompt_logprobs_reach_the_engine_and_max_tokens_0_asks_for_the_prompt_alone() -> None:
    got = _engine_side(SamplingParams(max_tokens=5, prompt_logprobs=3))
    assert (got.prompt_logprobs, got.max_tokens) == (3, 5)
    # The wire's max_tokens 0 is the engine default: prompt_only says "no token" (echo with max_tokens 0).
    alone = _engine_side(SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert (alone.prompt_logprobs, alone.max_tokens) == (0, 0)
    alone.validate(vocab_size=100)
    default = _engine_side(SamplingParams(prompt_logprobs=1))
    assert (default.prompt_logprobs, default.max_tokens) == (1, 16)
    assert _engine_side(SamplingParams()).prompt_logprobs is None
    engine = SimpleNamespace(max_model_len=64, config=SimpleNamespace(default_max_tokens=16))
    with pytest.raises(EngineError, match="prompt_only needs prompt_logprobs"):
        EngineService(engine)._sampling(pb.SamplingParams(prompt_only=True), 3)  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="max_tokens 0"):
        wire = pb.SamplingParams(prompt_only=True, prompt_logprobs=1, max_tokens=2)
        EngineService(engine)._sampling(wire, 3)  # type: ignore[arg-type]
