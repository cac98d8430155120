"""Where Ray learner actors run (pure logic): their Ray options, the cluster check, their log's path.

The real placement on a second Ray node is exercised in test_learners.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from toolgym.errors import ConfigError
from toolgym.training.distributed.ray_actors import actor_options, check_cluster_resources, learner_log_path

NODE = "ab" * 28  # a Ray node id: 28 bytes in hex


def test_a_learner_is_pinned_to_the_trainers_node_by_default() -> None:
    options = actor_options(cuda=False, nodes="trainer", resources={}, node_id=NODE)
    assert options["num_cpus"] == 0.0 and options["num_gpus"] == 0.0 and "resources" not in options
    assert options["scheduling_strategy"].node_id == NODE and not options["scheduling_strategy"].soft


def test_anywhere_a_learner_asks_for_its_resources_and_a_gpu_on_cuda() -> None:
    options = actor_options(cuda=True, nodes="any", resources={"learner_slot": 1}, node_id=NODE)
    assert "scheduling_strategy" not in options
    assert options["num_gpus"] == 1.0 and options["resources"] == {"learner_slot": 1.0}
    # CPU and GPU are Ray's num_cpus and num_gpus (Ray refuses them inside ``resources``)
    options = actor_options(cuda=True, nodes="any", resources={"CPU": 4, "GPU": 2}, node_id=NODE)
    assert (options["num_cpus"], options["num_gpus"]) == (4.0, 2.0) and "resources" not in options


def test_a_cluster_that_cannot_hold_the_learners_is_refused_by_name() -> None:
    options = actor_options(cuda=True, nodes="any", resources={"learner_slot": 1}, node_id=NODE)
    check_cluster_resources({"CPU": 8.0, "GPU": 3.0, "learner_slot": 3.0}, options, 3)  # fits exactly
    with pytest.raises(
        ConfigError, match=r"3 learner actor\(s\) need GPU=3 in all, and the Ray cluster has GPU=2"
    ):
        check_cluster_resources({"CPU": 8.0, "GPU": 2.0, "learner_slot": 3.0}, options, 3)
    with pytest.raises(
        ConfigError, match="learner_slot=2 in all, and the trainer's Ray node has learner_slot=0"
    ):
        check_cluster_resources({"GPU": 2.0}, options, 2, where="the trainer's Ray node")


def test_a_learner_logs_into_the_run_where_its_node_sees_it_else_into_its_temporary_directory(
    tmp_path: Path,
) -> None:
    assert learner_log_path(None) is None
    here = tmp_path / "learners" / "rank-1.log"
    here.parent.mkdir()
    assert learner_log_path(str(here)) == here
    elsewhere = learner_log_path(str(tmp_path / "not-on-this-node" / "rank-1.log"))
    assert elsewhere is not None and elsewhere.parent == Path(tempfile.gettempdir()) / "toolgym-learners"
    assert elsewhere.name.endswith("-rank-1.log")
    other_run = learner_log_path(str(tmp_path / "another-run" / "rank-1.log"))
    assert other_run != elsewhere  # two runs' rank 1 do not share a file
