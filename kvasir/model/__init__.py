"""Model sources and the converted-model cache, GGUF conversion, loading a stage's slice,
paged attention and the KV cache (layer 4; no sockets).

See docs/architecture.md."""
