"""Weights served as stored: GGUF's block formats kept packed through loading and serving."""
