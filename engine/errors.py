"""The engine's refusals: each names its gRPC status and says what was wrong."""

from __future__ import annotations


class EngineError(Exception):
    """A request or command the engine refuses; `code` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def prompt_too_long(prompt_len: int, max_model_len: int) -> EngineError:
    """The refusal of a prompt that leaves no room for output, worded as vLLM and OpenAI word it: clients
    (LiteLLM, LangChain) tell a context overflow by the phrase."""
    return EngineError(
        "INVALID_ARGUMENT",
        f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len}. "
        "Shorten the prompt.",
    )
