"""The head's policy: continuous batching, chunked prefill, fair KV admission, and block
bookkeeping (layer 4; no sockets).

See docs/architecture.md."""
