"""radixserve: a readable SGLang-style LLM serving engine."""

__version__ = "0.1.0"
