"""What a run writes: orbax checkpoints, and metrics (TensorBoard and metrics.jsonl)."""
