"""The embedded default model of `moeplug install demo`: a small synthetic qwen3moe, generated
offline on first use (random weights: its words mean nothing, its routing is real)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moeplug.core.paths import data_dir
from moeplug.core.progress import Note, ProgressFn, silent

if TYPE_CHECKING:
    from moeplug.model.synth import ModelSpec


def demo_model_path() -> Path:
    return data_dir() / "models" / "demo-qwen3moe-q8_0.gguf"


def demo_spec() -> ModelSpec:
    """The demo's synthetic model: 4 qwen3moe layers of 32 experts, 4 used, Q8_0."""
    from moeplug.model.synth import ModelSpec

    return ModelSpec(arch="qwen3moe", layers=4, experts=32, used=4, embd=256, expert_ff=256, dtype="q8_0", seed=1234,
                     name="moeplug-demo-qwen3moe")


def ensure_demo_model(progress: ProgressFn = silent) -> Path:
    from moeplug.model.synth import make_model

    path = demo_model_path()
    if not path.exists():
        progress(Note(f"generating the demo model: {path}"))
        make_model(demo_spec(), path)
    return path
