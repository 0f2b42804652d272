"""The adversarial suite (``sandbox_attacks.py`` beside this file): every attack scores 0, within its
timeout, and leaves nothing on the host; the sandbox still scores an honest completion afterwards.
Skipped where bubblewrap is missing or cannot sandbox (``make sandbox`` installs it)."""

from __future__ import annotations

import pytest

from tests.integration import sandbox_attacks
from unirl_lightning.rewards.sandbox import Sandbox, SandboxUnavailableError


def _sandbox_works() -> bool:
    try:
        return Sandbox().check() == "bwrap"
    except SandboxUnavailableError:
        return False


@pytest.mark.skipif(not _sandbox_works(), reason="bubblewrap is not installed or cannot sandbox here")
def test_every_attack_scores_zero_and_leaves_nothing_on_the_host():
    timeout_s = 3.0
    result = sandbox_attacks.run({"timeout_s": timeout_s})
    rows = {row["attack"]: row for row in result["attacks"]}
    assert len(rows) == 10 and result["sandbox"] == "bwrap"
    assert {name: row["score"] for name, row in rows.items()} == dict.fromkeys(rows, 0.0)
    assert {name: row["processes_left"] + row["files_left"] for name, row in rows.items()} == dict.fromkeys(
        rows, []
    )
    assert max(row["seconds"] for row in rows.values()) < timeout_s + 5  # a generous bound: the timeout rules
    assert result["connections_received"] == []
    assert result["new_repo_changes"] == [] and result["new_tmp_entries_with_marker"] == []
    assert result["free_disk_drop_bytes"] < 1 << 30  # not the 10 GB file (other processes write too)
    assert result["honest_after_attacks"]
    # what stopped them
    assert (
        rows["fork bomb"]["outcome"].startswith("returned ")
        and int(rows["fork bomb"]["outcome"].split()[1]) < 32
    )
    assert rows["allocate 10 GB"]["outcome"].startswith("MemoryError")
    assert int(rows["write a 10 GB file"]["outcome"].split()[1]) <= 2 * (64 << 20)  # two 64 MiB tmpfs mounts
    assert rows["read /etc/shadow"]["outcome"].startswith("FileNotFoundError")
    assert rows["a process that outlives the run"]["outcome"].startswith("killed after")
    assert rows["print 1 GB to stdout"]["outcome"] == "killed: output over the limit"
