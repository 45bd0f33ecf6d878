"""The embedded default policy: fixed limits from the config, no policy server needed.

Tenant/adapter permissions are already enforced by tenancy and the registry; this checker adds the
request-shape limits an operator sets once (largest `max_tokens`, longest prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api import PolicyDecision, PolicyInput

_ALLOW = PolicyDecision(allow=True)


@dataclass(frozen=True, slots=True)
class StaticPolicy:
    """A `PolicyChecker` allowing every request within `max_tokens` and `max_prompt_chars`."""

    max_tokens: int = 4096
    max_prompt_chars: int = 200_000

    async def check(self, item: PolicyInput) -> PolicyDecision:
        """Deny requests asking for more tokens or sending longer prompts than configured."""
        if item.max_tokens is not None and item.max_tokens > self.max_tokens:
            return PolicyDecision(False, f"max_tokens {item.max_tokens} exceeds the limit of {self.max_tokens}")
        if item.prompt_chars > self.max_prompt_chars:
            return PolicyDecision(
                False, f"prompt of {item.prompt_chars} characters exceeds the limit of {self.max_prompt_chars}"
            )
        return _ALLOW
