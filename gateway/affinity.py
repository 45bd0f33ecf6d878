"""Prefix affinity: requests whose prompts start alike go to the engine replica that served such a start last.

Each engine caches the keys and values of the prompts it served (`engine/prefix_cache.py`), per adapter version
and per tenant. Sent to the least loaded replica, the turns of one chat, or the requests that share a system
prompt, would spread over all replicas and find their start cached on one in N; steered to the replica that
served that start last, they find it there. The steer is bounded: when that replica is loaded more than
`LOAD_SLACK` of its capacity above the least loaded one, the request goes to the least loaded one instead (and
that one becomes the start's replica), so a popular system prompt cannot pile its traffic onto one engine.

A start is what the engine can share: the tenant and cache salt, the adapter version, and the first chat
message (its system prompt, or the first user turn every later turn repeats) or a plain prompt's first
`PROMPT_CHARS` characters.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from gateway.api import GatewayRequest

LOAD_SLACK = 0.25  # of a replica's capacity
PROMPT_CHARS = 1024
TABLE_SIZE = 65536  # starts remembered, least recently used dropped first


def affinity_key(request: GatewayRequest, engine_name: str | None) -> str:
    """The start of `request`'s prompt as the engines would share it (a digest)."""
    if request.messages:
        first = request.messages[0]
        start: list[str] = [first.role, first.content]
    else:
        start = [(request.prompt or "")[:PROMPT_CHARS]]
    text = json.dumps([request.tenant, request.cache_salt, engine_name, *start])
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class AffinityTable:
    """Which replica served each start last (by replica name), for the `TABLE_SIZE` starts seen last."""

    def __init__(self, size: int = TABLE_SIZE) -> None:
        self._size = size
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        return self._replicas.get(key)

    def record(self, key: str, replica: str) -> None:
        self._replicas[key] = replica
        self._replicas.move_to_end(key)
        if len(self._replicas) > self._size:
            self._replicas.popitem(last=False)
