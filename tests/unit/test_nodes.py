"""Where multi-node runs meet (training/launch/nodes.py) and who marks a node's checkpoints (training/rank.py), without
a launch: the config the nodes must agree on, the error that names what differs, the ranks of each node."""
import pytest

from core.config import ConfigError, load_config


def _yaml(*overrides):
    return load_config(None, list(overrides)).to_yaml()


def test_nodes_agree_on_everything_but_the_places_on_their_own_disks():
    from training.launch.nodes import config_digest

    base = config_digest(_yaml("training.runs_dir=/disk0/runs", "data.local_dir=/disk0/data"))
    assert config_digest(_yaml("training.runs_dir=/disk1/runs", "data.local_dir=/disk1/data",
                               "data.cache_dir=/elsewhere")) == base
    assert config_digest(_yaml("training.runs_dir=/disk0/runs", "data.local_dir=/disk0/data",
                               "training.max_steps=77")) != base


def test_a_node_with_another_config_is_told_which_settings_differ(tmp_path, monkeypatch):
    from training.launch import nodes

    monkeypatch.setenv("MASTER", "127.0.0.1:1")
    monkeypatch.setenv("NODE_RANK", "1")
    node0 = _yaml("parallel.collective_timeout_s=10", "training.seed=5")
    nodes.announce(tmp_path, node0, None, None)
    with pytest.raises(ConfigError) as err:
        nodes.wait_for_launch(tmp_path, _yaml("training.seed=5"), wait_s=1)
    assert "parallel.collective_timeout_s=10 on node 0 (here 120)" in str(err.value)
    assert "training.seed" not in str(err.value)
    assert nodes.wait_for_launch(tmp_path, _yaml("training.runs_dir=/mine", "parallel.collective_timeout_s=10",
                                                 "training.seed=5"), wait_s=1)["config_sha"]


@pytest.mark.parametrize("shared, owners, peers_of_3", [
    (True, [0], range(0, 4)),  # one run directory: rank 0 marks, over every rank's part
    (False, [0, 2], range(2, 4)),  # a disk per node: each node's first rank, over its node's ranks
])
def test_who_marks_a_checkpoint_complete(shared, owners, peers_of_3):
    from training.checkpoint.manager import checkpoint_roles

    config = load_config(None, ["parallel.nnodes=2", "parallel.data=4", "parallel.micro_batch_size=4",
                                "storage.uri=s3://bucket/p", f"storage.shared_filesystem={str(shared).lower()}"])
    layout = config.layout()
    roles = [checkpoint_roles(config.storage, layout, rank) for rank in range(4)]
    assert [rank for rank, (owner, _) in enumerate(roles) if owner] == owners
    assert roles[3][1] == peers_of_3


def test_node_0_on_an_empty_disk_continues_the_run_the_store_records(tmp_path, monkeypatch):
    """deploy/train-node.sh runs the first command on a disk without the run: node 0 continues the run the store
    records under that name (by its MLflow run id), a new name starts a new run."""
    from core.storage import Store
    from training.launch import train_run as train

    store = Store("s3://bucket/prefix")
    recorded = {"prefix/runs/apart/run.json": b'{"run_id": "f00d"}'}
    monkeypatch.setattr(store, "read", lambda key: recorded.get(key))
    config = load_config(None, [f"training.runs_dir={tmp_path / 'runs'}", "training.run_name=apart"])
    assert train._requeued(config, store) == "f00d"
    assert train._requeued(load_config(None, [f"training.runs_dir={tmp_path}", "training.run_name=new"]), store) == ""
    (tmp_path / "runs" / "apart").mkdir(parents=True)  # (this disk has it: deploy/train-node.sh resumes it by path)
    assert train._requeued(config, store) == ""
