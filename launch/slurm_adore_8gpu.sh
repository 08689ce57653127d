#!/usr/bin/env bash
# ADORE on MS MARCO passage, as one SLURM job on one node of 8 GPUs.
#
# Copy this file, edit the settings below (or set them in the environment), and run it on the cluster's login
# node from the top of a jdr checkout installed in .venv (pip install -e '.[gpu]'):
#
#   bash launch/slurm_adore_8gpu.sh             # write the sbatch script and submit it
#   bash launch/slurm_adore_8gpu.sh --dry-run   # print the sbatch script and the sbatch command only
#
# `python -m jdr.launch.slurm` writes the script: one task on the node that sees all 8 GPUs (JAX's usual
# layout), the coordinator taken from the node list. ADORE trains the query tower only, against the top-200
# of a fixed document index retrieved at every step; with the `jax` argument the retrieval is an exact top-k
# inside the jitted step over the corpus matrix sharded across the 8 GPUs (configs/adore.py lists the other
# arguments). ADORE starts from a trained retriever (INIT_FROM: a STAR or other jdr workdir / export); its
# document tower encodes the corpus once, before step 0 (or give CORPUS_ENCODING, a `jdr.encode` directory).
# A resubmitted job with the same WORKDIR resumes from its last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA="${DATA:-/shared/data/msmarco}"          # MS MARCO passage in BEIR layout on a filesystem every node sees
INIT_FROM="${INIT_FROM:-runs/star}"           # the trained retriever ADORE starts from
CORPUS_ENCODING="${CORPUS_ENCODING:-}"        # optional: the corpus already encoded by that model (jdr.encode)
WORKDIR="${WORKDIR:-runs/adore}"
PARTITION="${PARTITION:-gpu}"
TIME="${TIME:-24:00:00}"
SCRIPT="${SCRIPT:-adore-8gpu.sbatch}"
PYTHON="${PYTHON:-python}"

DRY_RUN=()
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=(--dry-run); fi
ENCODED=()
if [[ -n "$CORPUS_ENCODING" ]]; then ENCODED=(--config.negatives.retrieval.corpus_encoding="$CORPUS_ENCODING"); fi

"$PYTHON" -m jdr.launch.slurm --nodes 1 --gpus-per-node 8 --per host --partition "$PARTITION" --time "$TIME" \
    --job-name jdr-adore --setup "source .venv/bin/activate" --script "$SCRIPT" "${DRY_RUN[@]}" -- \
    python -m jdr.train --config configs/adore.py:jax --workdir "$WORKDIR" \
    --config.data.dataset="$DATA" --config.data.eval_split=dev --config.model.init_from="$INIT_FROM" "${ENCODED[@]}"
