#!/bin/bash
# Trains on every worker of a Cloud TPU VM slice (e.g. v5p-64: 8 workers).
#
#   TPU_NAME=my-slice ZONE=us-east5-a WORKDIR=/mnt/shared/runs/gpt2_small \
#       bash launch/tpu/train_on_pod.sh --config=configs/gpt2_small.py --config.trainer.batch_size=512
#
# The same command runs on all workers (--worker=all); jax.distributed finds the slice's workers
# from the TPU metadata, so no coordinator flags are needed. WORKDIR must be a filesystem every
# worker mounts (Filestore, or a GCS bucket through gcsfuse): orbax writes checkpoints from all.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${WORKDIR:?set WORKDIR to a shared path}"
REPO_DIR=${REPO_DIR:-levanter_flax}

# Copy this checkout to every worker and install it with the TPU build of jax.
tar czf /tmp/levanter_flax.tgz --exclude=.git --exclude=runs .
gcloud compute tpus tpu-vm scp /tmp/levanter_flax.tgz "$TPU_NAME": --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  mkdir -p $REPO_DIR && tar xzf levanter_flax.tgz -C $REPO_DIR &&
  cd $REPO_DIR && pip install -q -e '.[tpu]'"

# Preemption of a spot/preemptible slice sends SIGTERM: each worker checkpoints and exits 0;
# run this script again on the recreated slice to resume.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd $REPO_DIR && python -m levanter_flax.main --workdir=$WORKDIR $*"
