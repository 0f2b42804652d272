"""``load_once_per_node`` on 2 training ranks (CPU, gloo, DDP and FSDP2, with and without LoRA, with a
KL reference): rank 1 (``LOCAL_RANK=1`` from Lightning's launcher) builds its networks on the meta
device, and right after ``configure_model`` (before DDP's wrapper could sync anything) every
parameter, reference weight and buffer (rotary ``inv_freq`` included) of both ranks is the one a single
process builds; the ranks train to the same weights. Off, rank 1 loads its own. Each run is
tests/distributed/rank0_load_run.py in a subprocess (``placement="hybrid"``: no Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.rank0_load_run import module_for, tensor_digests

pytestmark = [pytest.mark.slow, pytest.mark.multirank]  # make test-multirank

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")
KL_COEF = 0.1


def run_two_ranks(out: Path, parallel: str, lora: int, load_once_per_node: bool = True) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES + ("SLURM_LOCALID",)}
    command = [sys.executable, str(ROOT / "tests" / "distributed" / "rank0_load_run.py"), "--out", str(out)]
    command += ["--parallel", parallel, "--lora", str(lora), "--kl-coef", str(KL_COEF)]
    command += ["--load-once-per-node", str(int(load_once_per_node))]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def expected_digests(lora: int) -> dict[str, str]:
    """What one process holds after ``setup`` (the reference copy taken, the masters made)."""
    module = module_for(lora, KL_COEF)
    assert not module.built_on_meta
    module.setup("fit")
    return tensor_digests(module)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("lora", [0, 4])
def test_rank_1_builds_on_meta_and_holds_rank_0s_weights_and_buffers_after_configure_model(
    tmp_path, parallel, lora
):
    ranks = run_two_ranks(tmp_path, parallel, lora)
    assert [rank["built_on_meta"] for rank in ranks] == [False, True]
    assert ranks[1]["local_rank_env"] == "1"
    expected = expected_digests(lora)
    assert ranks[0]["has_reference"] == (lora == 0)  # with LoRA the reference is the adapters switched off
    names = set(expected)
    assert any(name.endswith("inv_freq") for name in names), "the non-persistent rotary buffer is checked"
    assert any(name.startswith("ref_policy.") for name in names) == (lora == 0)
    assert any(".lora_A." in name for name in names) == (lora > 0)
    for rank in ranks:
        for when in ("after_configure_model", "at_start"):
            differing = sorted(n for n in names if rank[when].get(n) != expected[n])
            assert differing == [] and set(rank[when]) == names, (rank["rank"], when, differing)
    assert ranks[0]["trained"] == ranks[1]["trained"], "the ranks trained to different weights"


def test_with_load_once_per_node_off_every_rank_loads_its_own(tmp_path):
    ranks = run_two_ranks(tmp_path, "ddp", 0, load_once_per_node=False)
    assert [rank["built_on_meta"] for rank in ranks] == [False, False]
    expected = expected_digests(0)
    assert ranks[1]["after_configure_model"] == expected == ranks[0]["at_start"]
    assert ranks[0]["trained"] == ranks[1]["trained"]
