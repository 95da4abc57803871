"""Checkpoint managers for local checkpoints (NVRx module layout)."""
