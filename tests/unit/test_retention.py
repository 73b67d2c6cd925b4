"""Checkpoint retention (training.keep_checkpoints) on real checkpoint directories: what is kept, what `latest` and
the best resolve to, and that a checkpoint still being written or uploaded is never touched."""

from training.checkpoint.local import (COMPLETE_MARKER, LATEST_FILE, checkpoint_info, complete_checkpoints,
                                  latest_complete, mark_complete, prune, to_prune)


def _save(run_dir, step, eval_loss, complete=True):
    ckpt = run_dir / "checkpoints" / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model-00001-of-00001.safetensors").write_bytes(b"x" * 64)
    if complete:
        mark_complete(ckpt, {"step": step, "path": str(ckpt.resolve()), "eval_loss": eval_loss})
    return ckpt


def test_keep_two_over_six_saves_keeps_the_newest_two_and_the_best(tmp_path):
    losses = {10: 5.0, 20: 4.0, 30: 3.5, 40: 3.7, 50: 3.9, 60: 3.8}  # best: step 30
    removed_all = []
    for step, loss in losses.items():
        _save(tmp_path, step, loss)
        removed_all += [p.name for p in prune(tmp_path, 2, "eval_loss", step)]
    kept = [step for step, _ in complete_checkpoints(tmp_path)]
    assert kept == [30, 50, 60]
    assert sorted(removed_all) == ["checkpoint-10", "checkpoint-20", "checkpoint-40"]
    assert not (tmp_path / "checkpoints" / "checkpoint-40").exists()
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_text().strip() == "checkpoint-60"
    assert latest_complete(tmp_path).name == "checkpoint-60"
    best = min(complete_checkpoints(tmp_path), key=lambda sp: checkpoint_info(sp[1])["eval_loss"])
    assert best[0] == 30 and (best[1] / "model-00001-of-00001.safetensors").is_file()


def test_zero_keeps_everything(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, 10.0 - step)
        assert prune(tmp_path, 0, "eval_loss", step) == []
    assert len(complete_checkpoints(tmp_path)) == 4


def test_a_newer_checkpoint_being_written_and_an_upload_in_flight_are_left_alone(tmp_path):
    old = _save(tmp_path, 1, 9.0)
    _save(tmp_path, 2, 8.0)
    crashed = _save(tmp_path, 3, 0, complete=False)  # a crash left it half-written, older than the newest complete
    _save(tmp_path, 4, 7.0)
    writing = _save(tmp_path, 5, 0, complete=False)  # newer than the checkpoint that just completed: in progress
    removed = prune(tmp_path, 1, "eval_loss", 4, protect={str(old.resolve())})
    assert sorted(p.name for p in removed) == ["checkpoint-2", "checkpoint-3"]
    assert old.is_dir() and writing.is_dir() and not crashed.exists()
    assert not (writing / COMPLETE_MARKER).exists()


def test_to_prune_ties_and_unrated_checkpoints():
    rated = [(1, {"eval_loss": 2.0}), (2, {"eval_loss": 2.0}), (3, {}), (4, {"eval_loss": 3.0})]
    assert to_prune(rated, 1, "eval_loss") == {2, 3}  # the earliest of equal best losses is kept
    assert to_prune([(1, {}), (2, {}), (3, {})], 2, "eval_loss") == {1}
    assert to_prune(rated, 4, "eval_loss") == set()
