"""Weights served as stored: GGUF's block formats and quantized checkpoints' 4-bit words kept
packed through loading and serving."""
