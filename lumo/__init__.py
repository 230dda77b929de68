"""lumo: a single-GPU engine for hybrid Qwen3.5/3.8 models with exact tree speculative decoding."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "StructuredOutputs", "__version__"]


def __getattr__(name: str):
    # Lazy: `import lumo` must stay cheap for the CLI's argument parsing.
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "StructuredOutputs":
        from .engine.grammar import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(name)
