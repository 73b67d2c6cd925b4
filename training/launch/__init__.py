"""A training run's launcher (`make train`, `make finetune`), node by node: train_run.py is its top, read top-down.

    train_run.py    resolve -> prepare -> open -> launch -> close
    rundir.py       the run directory: new, found, prepared
    tracked_run.py  the MLflow run around it
    ranks.py        this node's ranks started and followed (supervise.py: their processes and signals; console.py:
                    progress; failures.py: which rank failed and why)
    nodes.py        more than one node: the announcement and the wait
    liveness.py     alive, dead and stale runs
    machine.py      what this machine can run (GPU checks)

It imports core/ and the rest of training/ only; the verbs (pipeline/train.py, pipeline/finetune.py) call it."""
