"""Which rank failed and why, from the ranks' logs (training/launch/failures.py), on hand-written logs. Fast."""
from core.config import load_config
from training.launch.failures import diagnose, failing_rank, rank_logs

STEP = "loss: 5.1, global_step: 3\n"
TRACEBACK = "Traceback (most recent call last):\n  File \"worker.py\"\nValueError: bad batch\n"
PEER_LOST = "RuntimeError: [gloo] Connection reset by peer while receiving\n"


def test_a_rank_with_its_own_exception_is_the_culprit():
    logs = {0: STEP + "Traceback\n" + PEER_LOST, 1: STEP + TRACEBACK, 2: STEP + PEER_LOST}
    rank, why, tail = failing_rank(logs)
    assert (rank, why) == (1, "raised an exception") and tail.endswith("ValueError: bad batch")


def test_a_silent_rank_whose_peers_lost_it_was_killed_from_outside():
    logs = {0: STEP + PEER_LOST, 1: STEP, 2: STEP + PEER_LOST}
    rank, why, _ = failing_rank(logs)
    assert rank == 1 and why.startswith("stopped without an error (killed?); rank 0 then lost its peer")


def test_gloos_pair_rank_names_the_lost_peer():
    logs = {0: STEP + "Error: gloo timed out, pair_rank = 3\n", 3: STEP + "Error: something\n"}
    rank, why, _ = failing_rank(logs)
    assert rank == 3 and why == "was lost by rank 0 (pair_rank = 3)"


def test_no_logs_and_no_errors():
    assert failing_rank({}) is None
    assert failing_rank({0: STEP, 1: STEP})[:2] == (0, "exited non-zero")


def test_the_tail_is_the_last_lines_only():
    _, _, tail = failing_rank({0: "".join(f"line {i}\n" for i in range(100)) + TRACEBACK})
    assert len(tail.splitlines()) == 40 and tail.splitlines()[-1] == "ValueError: bad batch"


def test_rank_logs_of_several_nodes_get_global_rank_numbers(tmp_path):
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        for local in (0, 1):
            (tmp_path / f"node{node}" / f"workerlog.{local}").write_text(f"node {node} local {local}")
    (tmp_path / "launcher.log").write_text("not a rank")
    found = rank_logs(tmp_path, procs_per_node=2)
    assert {rank: path.read_text() for rank, path in found.items()} == {
        0: "node 0 local 0", 1: "node 0 local 1", 2: "node 1 local 0", 3: "node 1 local 1"}


def test_diagnosis_lines(tmp_path):
    layout = load_config(None, ["parallel.data=2", "parallel.micro_batch_size=8", "training.global_batch_size=16"]).layout()
    (tmp_path / "checkpoints").mkdir()
    kind, line = diagnose(tmp_path, layout, 1, "raised an exception", {1: "OSError: [Errno 28] No space left on device"})
    assert kind == "disk_full" and f"make train RESUME={tmp_path}" in line and "MiB free" in line
    kind, line = diagnose(tmp_path, layout, 0, "raised an exception", {0: "MemoryError: Cannot allocate memory"})
    assert kind == "out_of_memory" and "rank 0 of layout dp2" in line and "make plan" in line
    kind, line = diagnose(tmp_path, layout, 1, "stopped without an error (killed?); ...", {1: STEP})
    assert kind == "killed" and "killed from outside" in line
    assert diagnose(tmp_path, layout, 0, "raised an exception", {0: TRACEBACK}) == ("", "")
