"""The fleet KV pool (layer 4; no sockets): full prefix blocks kept past an instance's
cache, each stage's slice stored apart with what it was made with and a checksum, in
tiers below the instances' own caches.

See docs/architecture.md."""
