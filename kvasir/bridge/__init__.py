"""The bridge process: clients' front door (submissions, per-request ledger, per-client
outboxes, detokenizing) between clients and the ring's head and tail (layer 5).

See docs/architecture.md."""
