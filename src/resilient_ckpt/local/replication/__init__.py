"""Replication of local checkpoints between ranks (NVRx module layout)."""
