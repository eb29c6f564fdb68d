"""The RL run: its assembly from a config (run_setup), the loop (loop.train), one step's sampled
and scored batch (collect) and evaluation (greedy / sampled accuracy, pass@k, maj@k, mean@k)."""
