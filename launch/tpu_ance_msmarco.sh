#!/usr/bin/env bash
# ANCE on MS MARCO passage, on a TPU VM pod slice: v4-32 (4 hosts x 4 chips) or v5e-32 (8 hosts x 4 chips).
#
# Copy this file, edit the settings below (or set them in the environment), and run it from the top of a jdr
# checkout on a workstation where `gcloud` is installed and logged in:
#
#   bash launch/tpu_ance_msmarco.sh             # every step below
#   bash launch/tpu_ance_msmarco.sh --dry-run   # print every command, run nothing
#
# Steps:
#   1. create the slice (CREATE=1; skip it for a slice you already have)
#   2. put MS MARCO on gs:// (LOCAL_DATA=a local copy to upload; skip it when DATA is already there). The data is
#      MS MARCO passage in BEIR layout (corpus.jsonl, queries.jsonl, qrels/train.tsv, qrels/dev.tsv), as BEIR
#      distributes it.
#   3. copy this working tree to every worker, install jdr[tpu] there and copy the data to each worker's disk
#      (the trainer reads a local directory; each host then parses only its own part of the corpus)
#   4. the warm-up ANCE starts from: BM25 negatives (configs/bm25_neg.py)
#   5. ANCE (configs/ance.py) from the warm-up's checkpoint, negatives from the model's own refreshed index
# Checkpoints, logs and exports go to gs:// (WORKDIR), so a preempted slice resumes where it stopped: run the
# step again with the same WORKDIR. Steps 3-5 go through `python -m jdr.launch.tpu`, which runs the same
# command on every worker; jax.distributed finds the other workers by itself on a TPU VM.
set -euo pipefail
cd "$(dirname "$0")/.."

TPU="${TPU:-jdr-ance}"                            # the slice's name
ZONE="${ZONE:-us-central2-b}"                     # v4: us-central2-b; v5e: e.g. us-west4-a
PROJECT="${PROJECT:-my-project}"
ACCELERATOR="${ACCELERATOR:-v4-32}"               # v4-32 or v5litepod-32 (v5e-32)
BUCKET="${BUCKET:-gs://my-bucket/jdr}"
DATA="${DATA:-$BUCKET/data/msmarco}"               # MS MARCO passage, BEIR layout
LOCAL_DATA="${LOCAL_DATA:-}"                      # a local copy to upload to DATA first ("" = already there)
WORKDIR="${WORKDIR:-$BUCKET/runs}"                # checkpoints and logs of both stages
MODEL="${MODEL:-minilm}"                          # the warm-up's start: a Hugging Face directory or minilm
CREATE="${CREATE:-0}"
PYTHON="${PYTHON:-python}"

DRY_RUN=()
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=(--dry-run); fi

case "$ACCELERATOR" in
  v4-32) WORKERS=4; VERSION=tpu-ubuntu2204-base ;;
  v5litepod-32|v5e-32) ACCELERATOR=v5litepod-32; WORKERS=8; VERSION=v2-alpha-tpuv5-lite ;;
  *) echo "error: ACCELERATOR=$ACCELERATOR: this file is written for v4-32 or v5litepod-32" >&2; exit 2 ;;
esac

# A command run here (not on the workers): printed under --dry-run, run otherwise.
here() {
  if (( ${#DRY_RUN[@]} )); then printf '$'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
on_workers() {
  "$PYTHON" -m jdr.launch.tpu --tpu "$TPU" --zone "$ZONE" --project "$PROJECT" --workers "$WORKERS" \
      "${DRY_RUN[@]}" "$@"
}
LOCAL_COPY=data/msmarco  # each worker's copy of DATA, inside its working tree (the commands run there)

# 1. the slice
if [[ "$CREATE" == 1 ]]; then
  here gcloud compute tpus tpu-vm create "$TPU" --zone "$ZONE" --project "$PROJECT" \
      --accelerator-type "$ACCELERATOR" --version "$VERSION"
fi

# 2. the data on gs://
if [[ -n "$LOCAL_DATA" ]]; then
  here gcloud storage rsync --recursive "$LOCAL_DATA" "$DATA"
fi

# 3. the code, its environment and the data on every worker
on_workers --copy . --setup "pip install -e '.[tpu]' && gcloud storage rsync --recursive $DATA $LOCAL_COPY" -- true

# 4. warm-up: BM25 negatives (ANCE's "BM25 Neg" starting point), with ANCE's towers: one shared tower, [CLS]
#    pooling and the 768-d projection head, which ANCE then keeps
on_workers -- python -m jdr.train --config configs/bm25_neg.py --workdir "$WORKDIR/bm25_neg" \
    --config.data.dataset="$LOCAL_COPY" --config.data.eval_split=dev --config.model.init_from="$MODEL" \
    --config.model.shared=True --config.model.pooling=cls --config.model.projection_dim=768

# 5. ANCE from the warm-up
on_workers -- python -m jdr.train --config configs/ance.py --workdir "$WORKDIR/ance" \
    --config.data.dataset="$LOCAL_COPY" --config.data.eval_split=dev \
    --config.model.init_from="$WORKDIR/bm25_neg"
