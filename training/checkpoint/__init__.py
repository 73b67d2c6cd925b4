"""The checkpoint room: everything about a run's checkpoints, on local disk and in the object store.

    local.py        on disk: the completion marker, `latest`, which are complete, retention, partial ones removed,
                    durability (fsync)
    async_write.py  PaddleNLP's checkpoint files written by a thread of each rank (training.async_checkpoint)
    manager.py      the rank's CheckpointManager (a Trainer callback): after a save, durable -> marked complete ->
                    retention -> queued for upload -> recorded in MLflow; at the end, what did not reach the store
    upload.py       rank 0's background upload to the store (files in parallel), markers and retention there
    in_store.py     the store's layout of a run, which checkpoints are complete there, fetching one (resume on an
                    empty disk, nodes without a shared disk), the record of checkpoints that never arrived
    lease.py        one writer per run: a flock on this machine, a lease with conditional writes in the store

The walk from `storage.uri`: training/launch/train_run.py (checks the store before launch, holds the lease, resumes) ->
training/launch/rundir.py (a run restored from the store) -> in_store.py / lease.py -> core/storage.py (the S3 client).
Ranks: training/rank.py -> manager.py -> upload.py -> in_store.py -> core/storage.py. Nothing outside this package writes
a completion marker or lists the store's checkpoints (tests/unit/test_checkpoint_room.py).
"""
