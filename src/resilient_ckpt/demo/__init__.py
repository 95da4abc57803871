"""The demo (``make demo``): tiered checkpoints on 4 CPU ranks, SIGKILL, a lost node, an
elastic restart on 2 ranks, bit-exact against an uninterrupted run."""
