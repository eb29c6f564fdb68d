"""What a run writes: orbax checkpoints, metrics.jsonl, and the experiment trackers (TensorBoard, W&B, MLflow)."""
