"""Tiered checkpointing end to end: 4 ranks, then 2, then 4 again, on one set of tiers.

Launch 1 (4 ranks, cliques {0,2} {1,3}, every 2nd save durable, keep 2 per tier) saves
steps 1-5 and checks: one snapshot per save (a durable save stages the same bytes as a
memory-only one, and its durable files are byte-identical to the memory tier's), the
memory layout (own file + the clique peer's copy + commit record, newest two steps), the
durable tier (steps 2 and 4, loaded by torch's own reader), then restores: normally; with a
flipped byte in one copy (the replica is used); after losing ranks 0 and 1's directories
(peers' copies are used); and with the only copy of a file corrupt (the older step 4 is
used). Launch 2 (2 ranks) restores step 4 from the directories of departed ranks
(elastic 4 -> 2, DTensor resharded) and trains on to step 7 (step 6 durable). Launch 3
(4 ranks) restores step 7 from memory (2 -> 4), then from durable step 6 once every memory
directory is gone, then fills a real tmpfs memory tier: the save fails on every rank with a
clear error, nothing torn is left, and the previous commit stays loadable.
"""

from __future__ import annotations

import pytest

from resilient_ckpt.testing import launch

from . import _jobs

pytestmark = [pytest.mark.dist]


def _served_by(files: dict[str, str], name: str) -> str:
    return files[name].split("/mem/")[1].split("/")[0]


@pytest.mark.timeout(400)
def test_tiers_replicas_elastic_and_capacity(tmp_path):
    root = str(tmp_path)
    four = launch(_jobs.four_ranks, 4, root, timeout=240)
    first = four[0]
    # 1. one snapshot: a durable save (2, 4) stages exactly the bytes of a memory-only one
    for facts in four:
        staged = facts["staged_bytes"]
        assert staged[2] == staged[3] == staged[4] and staged[2], staged
        assert facts["durable_same_bytes"]
    # 2. memory tier: own file + the clique peer's copy + commit record; newest two steps
    peer = {0: 2, 1: 3, 2: 0, 3: 1}
    for owner, steps in first["layout"].items():
        assert sorted(steps) == ["step_000000004", "step_000000005"], first["layout"]
        for files in steps.values():
            r = int(owner)
            assert files == sorted([".metadata", f"__{r}_0.distcp", f"__{peer[r]}_0.distcp"])
    # 3. durable tier: steps 2 and 4, standard DCP (torch's reader loads it)
    assert first["durable_dirs"] == ["step_000000002", "step_000000004"]
    assert all(f["torch_reads_durable"] for f in four)
    # 4. restores
    for facts in four:
        assert facts["restore"]["step"] == 5 and facts["restore"]["tier"] == "memory"
        assert facts["restore"]["exact"]
        flipped = facts["restore_flipped"]
        assert (flipped["step"], flipped["tier"], flipped["exact"]) == (5, "memory", True)
        if "__0_0.distcp" in flipped["files"]:
            assert _served_by(flipped["files"], "__0_0.distcp") == "2"
        lost = facts["restore_lost"]
        assert (lost["step"], lost["tier"], lost["exact"]) == (5, "memory", True)
        for name in lost["files"]:
            assert _served_by(lost["files"], name) in ("2", "3")
        older = facts["restore_older"]
        assert (older["step"], older["tier"], older["exact"]) == (4, "memory", True)
    assert "step_000000005" not in first["layout_after"]["2"]  # abandoned timeline purged

    # 5. elastic 4 -> 2 from the memory tier (the departed ranks' directories)
    two = launch(_jobs.two_ranks, 2, root, timeout=180)
    for facts in two:
        assert (facts["step"], facts["tier"], facts["exact"]) == (4, "memory", True)
        assert {_served_by(facts["files"], n) for n in facts["files"]} <= {"2", "3"}
        # retention reaches the departed ranks' directories once newer steps are committed
        assert facts["departed"] == {"2": {}, "3": {}}, facts["departed"]

    # 5. elastic 2 -> 4 from memory; 4. all memory lost -> durable; 2. the RAM tier full
    again = launch(_jobs.four_again, 4, root, timeout=240)
    for facts in again:
        elastic = facts["elastic"]
        assert (elastic["step"], elastic["tier"], elastic["exact"]) == (7, "memory", True)
        durable = facts["durable"]
        assert (durable["step"], durable["tier"], durable["exact"]) == (6, "durable", True)
    full = [facts["full"] for facts in again]
    if "skipped" in full[0]:
        pytest.skip(f"full-tier part needs a tmpfs mount: {full[0]['skipped']}")
    for facts in full:
        assert facts["error"] is not None and "No space left" in facts["error"], facts["error"]
        assert facts["step2_dirs"] == []  # nothing torn left behind
        assert facts["after_room"] == [3]
        assert (facts["restore"]["step"], facts["restore"]["exact"]) == (3, True)
