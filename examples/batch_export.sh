#!/usr/bin/env bash
# Batch export of saliency overlays with the command line.
#   bash examples/batch_export.sh [OUT]          # OUT defaults to out/batch_export
#   QUICK=1 bash examples/batch_export.sh /tmp/x  # CI smoke mode (skips the torchrun line)
# Each export shows a progress bar (add --quiet to hide it).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-out/batch_export}"

echo "[1/4] shapes-vit: rollout, cdam, generic overlays + maps + gallery"
# 1. the bundled samples with the bundled ViT: rollout + CDAM overlays, raw maps, a gallery
vitexplain export "$here/assets/samples" --out "$out/vit" --method rollout,cdam,generic --save-maps --html

echo "[2/4] the same command again: everything is current, nothing is redone"
# 2. a rerun skips everything that is complete and current (resume)
vitexplain export "$here/assets/samples" --out "$out/vit" --method rollout,cdam,generic --save-maps --html

echo "[3/4] shapes-cnn: gradcam and spatial-gate overlays"
# 3. the CNN zoo model with its gates and Grad-CAM
vitexplain export "$here/assets/samples" --out "$out/cnn" --model shapes-cnn --method gradcam,spatial

# 4. several processes (one shard each; gloo on CPU, nccl on GPU); on a GPU machine add
#    --device cuda --amp bf16 and set --nproc_per_node to the number of GPUs
if [ -z "${QUICK:-}" ]; then
  echo "[4/4] two processes (torchrun), one shard each"
  python -m torch.distributed.run --nproc_per_node=2 -m vitexplain export "$here/assets/samples" \
      --out "$out/distributed" --method rollout,cdam
fi
echo "wrote $out (open $out/vit/index.html)"
