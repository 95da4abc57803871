"""The benchmarks' shared helpers live in the package (``resilient-ckpt bench`` runs from an
installed package); re-exported here for the scripts of this directory."""

from resilient_ckpt.cli.bench.common import (  # noqa: F401
    Figures,
    dd_write_seconds,
    human,
    make_state,
    median_time,
    parse_size,
    print_table,
)
