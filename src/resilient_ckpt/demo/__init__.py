"""The demo: async checkpointed training, killed, resumed bit-exact (``make demo``)."""
