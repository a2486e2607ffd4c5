"""kvdepot: a KV-cache server daemon for LLM serving engines."""

__version__ = "0.1.0"
