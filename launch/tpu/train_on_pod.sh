#!/bin/bash
# Trains on every worker of a Cloud TPU VM slice (e.g. v5p-64: 8 workers).
#
#   TPU_NAME=my-slice ZONE=us-east5-a WORKDIR=gs://my-bucket/runs/gpt2_small \
#       bash launch/tpu/train_on_pod.sh --config=configs/gpt2_small.py --config.trainer.batch_size=512 \
#       --config.data.dataset=gs://my-bucket/data/my_corpus
#
# The same command runs on all workers (--worker=all); jax.distributed finds the slice's workers
# from the TPU metadata, so no coordinator flags are needed. WORKDIR is a gs:// path (or one every
# worker mounts): orbax writes each checkpoint from all workers, straight to Cloud Storage. The
# workers authenticate as the TPU VM's service account, which needs read and write access to the
# bucket (roles/storage.objectUser).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${WORKDIR:?set WORKDIR to a gs:// path}"
REPO_DIR=${REPO_DIR:-levanter_flax}

# Every value that goes into the workers' shell is quoted for it: paths and flags may hold spaces
# or shell characters.
quoted() { printf '%q ' "$@"; }

# Copy this checkout to every worker and install it with the TPU build of jax. The archive has a
# name of its own, so two launches from one machine do not overwrite each other's.
archive=$(mktemp --suffix=.levanter_flax.tgz)
trap 'rm -f "$archive"' EXIT
tar czf "$archive" --exclude=.git --exclude=runs .
remote_archive=$(basename "$archive")
gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME": --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  mkdir -p $(quoted "$REPO_DIR") && tar xzf $(quoted "$remote_archive") -C $(quoted "$REPO_DIR") &&
  rm -f $(quoted "$remote_archive") && cd $(quoted "$REPO_DIR") && pip install -q -e '.[tpu]'"

# Preemption of a spot/preemptible slice sends SIGTERM: every worker stops after the same step,
# one checkpoint is written, and all exit 0; run this script again on the recreated slice to
# resume, on any number of workers that divides the run's data.reader_groups.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd $(quoted "$REPO_DIR") && python -m levanter_flax.main $(quoted "--workdir=$WORKDIR" "$@")"
