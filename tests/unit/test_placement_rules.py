"""The pure rules of rollout-worker placement: trainer GPUs are never a worker's, device mapping,
tensor parallelism vs GPUs per worker, bundles, the free-resource check, the placement report.
No Ray runs here."""

from __future__ import annotations

import json
import os

import pytest
import torch

from unirl_lightning.workers.placement import (
    cuda_index,
    find_overlaps,
    local_ray_gpus,
    missing_resources,
    only_gpus,
    placement_report,
    spare_gpu_ids,
    tensor_parallel_size_for,
    trainer_placement_info,
    visible_gpu_ids,
    wanted_resources,
    worker_bundles,
    worker_device,
)

FOUR_TRAINERS = [torch.device(f"cuda:{k}") for k in range(4)]  # Lightning's parallel_devices, devices: 4


def test_visible_ids_come_from_cuda_visible_devices_else_the_count():
    assert visible_gpu_ids(None, 3) == ["0", "1", "2"]
    assert visible_gpu_ids("4, 5,6", 8) == ["4", "5", "6"]  # the variable wins over the count
    assert visible_gpu_ids("", 8) == []  # set but empty: no GPU
    assert visible_gpu_ids("GPU-aa,GPU-bb") == ["GPU-aa", "GPU-bb"]


def test_cuda_index():
    assert [cuda_index(d) for d in ("cuda:3", "cuda", torch.device("cuda", 1), "cpu", "mps")] == [
        3,
        0,
        1,
        None,
        None,
    ]


def test_trainer_devices_are_never_given_to_workers():
    visible = visible_gpu_ids(None, 8)
    spare = spare_gpu_ids(visible, FOUR_TRAINERS)
    assert spare == ["4", "5", "6", "7"]
    assert not set(spare) & {"0", "1", "2", "3"}
    # any subset of trainer devices, in any order: the spare ids are exactly the others
    for trainers in ([torch.device("cuda:7")], ["cuda:2", "cuda:0"], [], [torch.device("cpu")] * 2):
        held = {visible[cuda_index(d)] for d in trainers if cuda_index(d) is not None}
        spare = spare_gpu_ids(visible, trainers)
        assert not set(spare) & held and set(spare) | held == set(visible)


def test_cuda_visible_devices_remaps_trainer_indices():
    # with CUDA_VISIBLE_DEVICES=2,3,6,7,0,1 the trainer's cuda:0..3 are GPUs 2,3,6,7
    visible = visible_gpu_ids("2,3,6,7,0,1", 8)
    assert spare_gpu_ids(visible, FOUR_TRAINERS) == ["0", "1"]
    assert local_ray_gpus(["cuda:1", "cuda:3"], 2, "5,4,3,2") == ["5", "3"]
    assert local_ray_gpus(FOUR_TRAINERS, 4, "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g,GPU-h") == [
        "GPU-e",
        "GPU-f",
        "GPU-g",
        "GPU-h",
    ]


def test_a_trainer_device_that_is_not_visible_is_an_error():
    with pytest.raises(ValueError, match=r"cuda:4.*4 visible GPU\(s\)"):
        spare_gpu_ids(["0", "1", "2", "3"], ["cuda:0", "cuda:4"])


def test_cpu_trainers_leave_every_gpu():
    assert local_ray_gpus([torch.device("cpu")], 0, None, 0) == []
    assert local_ray_gpus(["cpu", "cpu"], 2, None, 2) == ["0", "1"]


def test_asking_for_more_gpus_than_are_spare_names_the_numbers():
    with pytest.raises(ValueError) as info:
        local_ray_gpus(FOUR_TRAINERS, 5, None, 8)  # e.g. 5 workers x 1 GPU
    message = str(info.value)
    assert "ask for 5 GPU(s)" in message and "only 4 of the 8 visible are free" in message
    assert "['4', '5', '6', '7']" in message
    assert local_ray_gpus(FOUR_TRAINERS, 4, None, 8) == ["4", "5", "6", "7"]  # exactly enough
    assert local_ray_gpus(FOUR_TRAINERS, 3.5, None, 8) == ["4", "5", "6", "7"]  # shares of GPUs
    with pytest.raises(ValueError, match="ask for 1 GPU.*only 0 of the 4"):
        local_ray_gpus(FOUR_TRAINERS, 1, "0,1,2,3")


def test_only_gpus_sets_and_restores_the_variable(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    with only_gpus(["4", "5"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError), only_gpus([]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        raise RuntimeError
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_worker_device():
    assert worker_device(torch.device("cuda:3")) == "cuda:0"  # an actor sees its own GPUs from 0
    assert worker_device("cuda") == "cuda:0"
    assert worker_device(torch.device("cpu")) == "cpu"
    assert worker_device("cpu") == "cpu"


def test_tensor_parallel_follows_num_gpus_per_worker_or_must_agree():
    assert tensor_parallel_size_for(0) == 1
    assert tensor_parallel_size_for(0.5) == 1
    assert tensor_parallel_size_for(1) == 1
    assert tensor_parallel_size_for(4) == 4
    assert tensor_parallel_size_for(2, 2) == 2
    assert tensor_parallel_size_for(0.5, 1) == 1
    assert tensor_parallel_size_for(0, 1) == 1
    for gpus, tp in ((1, 2), (2, 1), (4, 2), (0, 2), (1.5, None), (2.5, 2), (2, 0)):
        with pytest.raises(ValueError) as info:
            tensor_parallel_size_for(gpus, tp)
        assert f"tensor_parallel_size={tp}" in str(info.value)
        assert f"num_gpus_per_worker={gpus:g}" in str(info.value)


def test_bundles_of_one_worker():
    assert worker_bundles(8, 1) == ([{"CPU": 8.0, "GPU": 1.0}], "STRICT_PACK")
    assert worker_bundles(1, 0) == ([{"CPU": 1.0}], "STRICT_PACK")  # zero amounts are left out
    assert worker_bundles(2, 2, {"rollout_node": 1}) == (
        [{"CPU": 2.0, "rollout_node": 1.0, "GPU": 2.0}],
        "STRICT_PACK",
    )
    bundles, strategy = worker_bundles(2, 4, {"node:10.0.0.5": 0.01}, layout="per_gpu")
    assert strategy == "STRICT_PACK"  # a worker's GPUs on one node
    assert bundles == [{"CPU": 2.0, "node:10.0.0.5": 0.01, "GPU": 1.0}] + [{"GPU": 1.0}] * 3
    with pytest.raises(ValueError, match="whole num_gpus_per_worker"):
        worker_bundles(1, 1.5, layout="per_gpu")
    with pytest.raises(ValueError, match="layout"):
        worker_bundles(1, 1, layout="spread")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no placement group"):
        worker_bundles(0, 0)


def test_wanted_and_missing_resources():
    bundles, _ = worker_bundles(2, 2, {"rollout_node": 1}, layout="per_gpu")
    wanted = wanted_resources(3, bundles)
    assert wanted == {"CPU": 6.0, "rollout_node": 3.0, "GPU": 6.0}
    free = {"CPU": 8.0, "GPU": 4.0, "rollout_node": 4.0, "memory": 1e9}
    assert missing_resources(wanted, free) == {"GPU": (6.0, 4.0)}
    assert missing_resources(wanted, {}) == {"CPU": (6.0, 0.0), "rollout_node": (3.0, 0.0), "GPU": (6.0, 0.0)}
    assert missing_resources({"GPU": 0.3 * 10}, {"GPU": 3.0}) == {}  # float sums are not short


def _worker(index, ip, gpus, node="n" * 56):
    return {
        "worker": index,
        "node_ip": ip,
        "node_id": node,
        "gpu_ids": gpus,
        "cuda_visible_devices": ",".join(gpus),
    }


def test_the_report_lists_every_rank_and_worker_and_flags_shared_gpus(tmp_path):
    visible = visible_gpu_ids(None, 8)
    trainers = [trainer_placement_info(r, f"cuda:{r}", visible, node_ip="10.0.0.1") for r in range(4)]
    assert trainers[2] == {"rank": 2, "node_ip": "10.0.0.1", "device": "cuda:2", "gpu_ids": ["2"]}
    workers = [_worker(i, "10.0.0.1", [str(4 + i)]) for i in range(4)]
    table = placement_report(trainers, workers, str(tmp_path))
    assert len(table.splitlines()) == 1 + 4 + 4 + 1
    assert "no GPU is shared" in table and "OVERLAP" not in table
    saved = json.loads((tmp_path / "placement.json").read_text())
    assert saved["trainers"] == trainers and saved["workers"] == workers and saved["overlaps"] == []

    clash = [_worker(0, "10.0.0.1", ["3"]), _worker(1, "10.0.0.2", ["0"])]  # GPU 0 of another machine: fine
    assert find_overlaps(trainers, clash) == [
        "rollout worker 0 shares GPU 3 on 10.0.0.1 with training rank 3"
    ]
    table = placement_report(trainers, clash)
    assert "OVERLAP: rollout worker 0 shares GPU 3" in table
    cpu = trainer_placement_info(0, torch.device("cpu"), [], node_ip="10.0.0.1")
    assert cpu["gpu_ids"] == [] and find_overlaps([cpu], clash) == []


def test_the_report_records_reward_workers_and_flags_one_on_a_training_gpu(tmp_path):
    visible = visible_gpu_ids(None, 8)
    trainers = [trainer_placement_info(r, f"cuda:{r}", visible, node_ip="10.0.0.1") for r in range(2)]
    workers = [_worker(0, "10.0.0.1", ["2"])]
    scorer = {**_worker(0, "10.0.0.1", ["3"]), "reward_worker": 0}
    del scorer["worker"]
    table = placement_report(trainers, workers, str(tmp_path), [scorer])
    saved = json.loads((tmp_path / "placement.json").read_text())
    assert saved["reward_workers"] == [scorer] and saved["overlaps"] == []
    assert [line.split()[0] for line in table.splitlines()] == [
        "role",
        "trainer",
        "trainer",
        "worker",
        "reward",
        "no",
    ]
    placement_report(trainers, workers, str(tmp_path / "plain"))
    assert "reward_workers" not in json.loads((tmp_path / "plain" / "placement.json").read_text())
    clash = {**scorer, "gpu_ids": ["1"]}
    assert find_overlaps(trainers, workers, [clash]) == [
        "reward worker 0 shares GPU 1 on 10.0.0.1 with training rank 1"
    ]


def test_a_local_ray_for_gpu_trainers_gets_the_spare_gpus_and_none_on_a_cpu_machine(monkeypatch):
    from unirl_lightning.workers import cluster

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    assert cluster._spare_gpus(FOUR_TRAINERS, 4) == ["3", "2", "1", "0"]
    assert cluster._spare_gpus([], 2) == ["7", "6", "5", "4", "3", "2", "1", "0"]  # colocate: every GPU
    with pytest.raises(ValueError, match="ask for 5 GPU"):
        cluster._spare_gpus(FOUR_TRAINERS, 5)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cluster._spare_gpus([torch.device("cpu")], 0) == [str(i) for i in range(8)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cluster._spare_gpus([torch.device("cpu")], 0) is None  # no GPU: Ray starts as before


def test_several_nodes_need_a_ray_cluster_spanning_them():
    from unirl_lightning.core.preflight import multi_node_ray_error

    assert multi_node_ray_error(1, None) is None and multi_node_ray_error(2, "10.0.0.1:6379") is None
    message = multi_node_ray_error(2, None)
    assert message.startswith(
        "trainer.num_nodes=2 needs a Ray cluster spanning the nodes, but RAY_ADDRESS is not set"
    )
    assert "set RAY_ADDRESS on every node" in message


def test_the_strategy_refuses_several_nodes_without_ray_address_before_ray_starts(monkeypatch):
    import pytest

    from unirl_lightning.strategy import AsyncRolloutDDPStrategy

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    strategy = AsyncRolloutDDPStrategy()
    strategy.num_nodes = 2  # Lightning sets it from Trainer(num_nodes=2)
    with pytest.raises(ValueError, match=r"trainer.num_nodes=2 needs a Ray cluster spanning the nodes"):
        strategy.preflight(world_size=4)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    strategy.preflight(world_size=4)  # joins that cluster: Ray places the workers on every node
