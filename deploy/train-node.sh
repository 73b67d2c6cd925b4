#!/usr/bin/env bash
# One node of a multi-node training job: the same command on every node, first launch and requeue alike.
#
# Contract (set by deploy/slurm/train.sbatch, deploy/kubernetes/paddlejob-train.yaml, or by hand):
#   MASTER=<host:port of node 0>  NODE_RANK=<0..NNODES-1>  NNODES=<nodes>
#   RUNS_DIR=<a directory every node mounts (shared storage); or the node's own disk with EXTRA_ARGS
#            "storage.uri=s3://... storage.shared_filesystem=false" (the nodes meet in the object store)>
#   RUN_NAME=<the same on every node>
#   CONFIG=<configs/x.yaml>  EXTRA_ARGS="<more key=value overrides>"  DRY_RUN=1 (print the layout only)
#   DEVICE=gpu (default; the Paddle build `make setup` installs)
#   PIPELINE_LAUNCH_ID=<unique per launch, e.g. job id + restart count> (default: MASTER)
# If the run directory exists (a requeued or restarted job), the run continues from its latest complete checkpoint
# in the same MLflow run; otherwise node 0 creates it and the other nodes wait for it (parallel.node_wait_s).
set -euo pipefail
: "${MASTER:?set MASTER=<host:port> of node 0}" "${NODE_RANK:?set NODE_RANK}" "${NNODES:?set NNODES}"
: "${RUNS_DIR:?set RUNS_DIR to a directory on storage every node shares}" "${RUN_NAME:?set RUN_NAME}"
CONFIG=${CONFIG:-configs/llama-100b-512gpu.yaml}
EXTRA_ARGS=${EXTRA_ARGS:-}
DEVICE=${DEVICE:-gpu}
export MASTER NODE_RANK
cd "${REPO_DIR:-$(dirname "$0")/..}"
args="parallel.nnodes=$NNODES $EXTRA_ARGS"
if [ -f "$RUNS_DIR/$RUN_NAME/config.yaml" ]; then
  echo "node $NODE_RANK: continuing $RUNS_DIR/$RUN_NAME"
  exec make -s train DEVICE="$DEVICE" RESUME="$RUNS_DIR/$RUN_NAME" ARGS="$args" DRY_RUN="${DRY_RUN:-}"
fi
echo "node $NODE_RANK: new run $RUNS_DIR/$RUN_NAME"
exec make -s train DEVICE="$DEVICE" CONFIG="$CONFIG" ARGS="training.runs_dir=$RUNS_DIR training.run_name=$RUN_NAME $args" \
  DRY_RUN="${DRY_RUN:-}"
