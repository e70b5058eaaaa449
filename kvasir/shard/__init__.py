"""An expert shard process: one range of a stage's experts for every MoE layer of the
stage, computing the rows the stage dispatches to it (layer 5, beside the stage).

See docs/architecture.md."""
