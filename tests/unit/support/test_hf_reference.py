"""Self-checks of the transformers/peft reference and of the demo adapters it loads."""

from __future__ import annotations

import pytest

from tests.support import hf_reference as ref
from tests.support.model_files import DEMO_ADAPTERS, demo_adapter_dir, smollm2_gguf_path

# Different lengths on purpose: the batch needs real left padding.
QUESTIONS = (
    "Hi!",
    "What is the capital of Italy?",
    "Tell me something about elephants, and explain why they have such long trunks.",
    "How do I make a cup of tea?",
    "What is your advice for a job interview?",
)
MAX_NEW_TOKENS = 16

needs_demo_adapters = pytest.mark.skipif(
    not all((demo_adapter_dir(n) / "adapter_model.safetensors").is_file() for n in DEMO_ADAPTERS),
    reason="demo adapters not trained (python scripts/train_demo_adapters.py)",
)


def _prompts() -> list[list[int]]:
    return [ref.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_gguf_is_found() -> None:
    assert smollm2_gguf_path().stat().st_size > 50_000_000


def test_chat_prompt_ends_with_assistant_header() -> None:
    _, tokenizer = ref.load_reference_model()
    (text,) = tokenizer.batch_decode([ref.chat_prompt_ids([{"role": "user", "content": "Hello there"}])])
    assert "<|im_start|>user\nHello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_base_padded_batch_equals_unpadded_rows() -> None:
    prompts = _prompts()
    assert len({len(p) for p in prompts}) >= 3
    batched = ref.greedy_generate(prompts, [None] * len(prompts), MAX_NEW_TOKENS)
    single = [ref.greedy_generate([p], [None], MAX_NEW_TOKENS)[0] for p in prompts]
    assert batched == single
    assert all(0 < len(row) <= MAX_NEW_TOKENS for row in batched)


@needs_demo_adapters
def test_mixed_adapter_batch_equals_unpadded_rows() -> None:
    prompts = _prompts()
    names = [None, "pirate", "shout", "robot", "pirate"]
    batched = ref.greedy_generate(prompts, names, MAX_NEW_TOKENS)
    single = [ref.greedy_generate([p], [n], MAX_NEW_TOKENS)[0] for p, n in zip(prompts, names, strict=True)]
    assert batched == single
    # Base rows of a peft model with adapters loaded are the plain base model's rows.
    base = ref.greedy_generate([prompts[0]], [None], MAX_NEW_TOKENS, model=ref.load_reference_model()[0])
    assert batched[0] == base[0]


def test_eos_is_not_returned() -> None:
    _, tokenizer = ref.load_reference_model()
    # "Hi!" gets a short answer that ends well before the limit.
    (row,) = ref.greedy_generate([_prompts()[0]], [None], 64)
    assert len(row) < 64
    assert tokenizer.eos_token_id not in row


@needs_demo_adapters
@pytest.mark.parametrize("question", ["What is the capital of Italy?", "How do I make a cup of tea?"])
def test_demo_adapters_change_style(question: str) -> None:
    _, tokenizer = ref.load_reference_model()
    prompt = ref.chat_prompt_ids([{"role": "user", "content": question}])
    names: list[str | None] = [None, *DEMO_ADAPTERS]
    rows = ref.greedy_generate([prompt] * len(names), names, MAX_NEW_TOKENS)
    texts = dict(zip(names, tokenizer.batch_decode(rows), strict=True))
    assert not texts[None].startswith(("Arr", "BEEP"))
    assert texts["pirate"].startswith("Arr, matey!")
    letters = [c for c in texts["shout"] if c.isalpha()]
    assert len(letters) > 10
    assert all(c.isupper() for c in letters), texts["shout"]
    assert texts["robot"].startswith("BEEP BOOP.")
