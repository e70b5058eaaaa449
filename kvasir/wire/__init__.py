"""Every message Kvasir exchanges, as msgspec Structs: one module per socket edge, one tagged
union per receiving socket.

The batch descriptor is decided once by the head and travels unchanged to every stage;
each message carries only what its receiver lacks (a request's sampling spec on its
first appearance, a row's KV blocks as growth since the stage last saw the request).
Tensors never travel inside these bodies: boundaries sit in slots (shared memory,
page-locked shared memory or CUDA IPC buffers) and descriptors name the slot.

Edges:
    client  -> bridge   ClientMessage   (Submit | Cancel | StatsQuery)
    bridge  -> client   ClientEvent     (Accepted | TokenOut | Finished | Cancelled | ErrorEvent | StatsReply)
    bridge  -> PUB      TokenOut
    bridge, tail -> head HeadMessage    (Enqueue | CancelRequest | BatchResult)
    stage k -> stage k+1 BatchDescriptor
    stage k+1 -> stage k Credit
    stages  -> bridge   BridgeMessage   (TokenEvents | RequestEnded | StageStats | ShardStats | HandoffReport)
    stage <-> its expert shards  ExpertMessage (ExpertWork | ExpertDone); rows in the shard's dispatch slot

A disaggregated plan runs two rings (docs/architecture.md, "Two pools"): the prefill pool's and the
decode pool's. Their heads and stages add:
    prefill tail -> decode head  HeadMessage (Handoff)
    prefill head -> decode head  HeadMessage (KvDrop | CancelRequest)
    decode head -> prefill head  HeadMessage (KvPlaced | Adopted)
    decode stage -> decode head  HeadMessage (KvHeld)
    prefill stage, decode head -> decode stage  KvMessage (KvReady | Placement)
    children -> launcher ControlMessage (Ready | Drained | Heartbeat | EdgeHandles)
    launcher -> children Command

Modules: base (struct bases, limits), batch (descriptors, rows, credits), head (the
head's inbox), kv (KV hand-off to decode stages), bridge (stages to the bridge), client
(clients), control (the launcher and its children), experts (a stage and its expert
shards), hosts (the launcher and each follower); decoding (the strict decoders every
receiver uses); shares (busy / starved / blocked from the stages' statistics). How they
travel (sockets, CURVE, routes, the runtime dir) is kvasir/transport/.
"""
