#!/usr/bin/env bash
# Several jdr processes on one host, joined by jax.distributed as the hosts of a cluster would be: the way to
# try a multi-host run (per-host data parts, global batches, checkpoints written once) before paying for one.
#
#   bash launch/local_multiprocess.sh             # 2 processes x 2 simulated CPU devices, the demo recipe
#   bash launch/local_multiprocess.sh --dry-run   # print each process's command and environment, run nothing
#
# `python -m jdr.launch.local` starts the processes with the coordinator on localhost; each simulates
# DEVICES CPU devices, so the mesh holds PROCESSES x DEVICES devices and the batch must split over them.
# Process 0's output is shown; the others write to LOG_DIR. Swap the recipe and the data for your own.
set -euo pipefail
cd "$(dirname "$0")/.."

PROCESSES="${PROCESSES:-2}"
DEVICES="${DEVICES:-2}"                        # simulated CPU devices per process
CONFIG="${CONFIG:-configs/demo.py:tiny}"        # a tiny random BERT on the built-in docstring data
WORKDIR="${WORKDIR:-runs/local-multiprocess}"
LOG_DIR="${LOG_DIR:-$WORKDIR-logs}"
PYTHON="${PYTHON:-python}"

DRY_RUN=()
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=(--dry-run); fi

"$PYTHON" -m jdr.launch.local --processes "$PROCESSES" --devices-per-process "$DEVICES" --log-dir "$LOG_DIR" \
    "${DRY_RUN[@]}" -- \
    "$PYTHON" -m jdr.train --config "$CONFIG" --workdir "$WORKDIR" --config.num_train_steps=40
