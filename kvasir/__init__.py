"""Kvasir: an LLM serving daemon that runs a model as an in-flight ring of pipeline stages."""

__version__ = "0.1.0"
