#!/usr/bin/env bash
# The slurm/ templates on a real SLURM: a one-node cluster on this machine (cluster.sh), the CPU
# backend, the bundled demo. Submits with sbatch, as a user would (from the repository root,
# settings exported, `--gpus-per-node=0` because the test node has no GPU):
#   1. pretrain_single.sh; 2. pretrain_node.sh with two replicas (AAM_DEVICES=0,0; dropout and
#      masking off); 7. pretrain_multi.sh as two tasks on the one node (--ntasks=2, one replica
#      each): ranks and rendezvous from SLURM, sums across the processes with burn-collective;
#      ends with job 2's metrics and weights (benches/compare_runs.py, tolerance 1e-5);
#   3. train.sh from the first job's encoder; 4. predict.sh with the third job's model;
#   5. unifrac.sh (the demo's tree): within 1e-6 of the demo's ssu matrix (`unifrac-bench compare`);
#   6. pretrain_single.sh again, sent SLURM's time-limit warning (USR1 to the batch shell) mid-run:
#      it writes a checkpoint, exits 75, requeues itself, resumes on its next start, and ends with
#      the metrics and weights of job 1 (benches/compare_runs.py, tolerance 0).
# Needs root (cluster.sh installs and starts SLURM), an aam-rs binary with the ndarray backend
# (AAM_RS, default target/release/aam-rs) and unifrac-bench (UNIFRAC_BENCH, default
# target/release/unifrac-bench): `cargo build --release -p aam-cli -p aam-benches --bin aam-rs
# --bin unifrac-bench`. WORK (default /tmp/aam-slurm-test) holds the runs.
# Prints one line per check; exits 1 at the first failure, with the job's output.
set -euo pipefail
cd "$(dirname "$0")/../.."
AAM_RS=$(realpath "${AAM_RS:-target/release/aam-rs}")
UNIFRAC_BENCH=$(realpath "${UNIFRAC_BENCH:-target/release/unifrac-bench}")
WORK=${WORK:-/tmp/aam-slurm-test}
rm -rf "$WORK"
mkdir -p "$WORK"
bash slurm/test/cluster.sh
DEMO=$PWD/crates/data/demo
export AAM_RS AAM_BACKEND=ndarray AAM_SCRATCH="$WORK/scratch"
# The demo model of the README, small enough for a CPU; a step checkpoint every 2 steps.
ARGS="--rarefy-depth 1000 --max-bp 100 --token-limit 256 --embedding-dim 64 --attention-layers 2 \
--epochs 3 --warmup-steps 20 --lr 5e-4 --batch-size 8"
started=$SECONDS

fail() {
  echo "FAIL: $*" >&2
  for f in "$WORK"/*.out; do echo "== $f" >&2; tail -20 "$f" >&2; done
  exit 1
}

# submit NAME TEMPLATE [VAR=value ...]: submits and waits for the job to end; fails on a failed job.
submit() {
  local name=$1 template=$2
  shift 2
  env "$@" sbatch --wait --parsable --gpus-per-node=0 --cpus-per-task=2 --job-name="aam-test-$name" \
    --output="$WORK/$name.out" "slurm/$template" > "$WORK/$name.id" || fail "$name ($template) failed"
  echo "ok   $name: $template, job $(cat "$WORK/$name.id"), $((SECONDS - started)) s"
}

# Relative paths, as a user submitting from the repository root writes them.
submit single pretrain_single.sh AAM_TABLE=crates/data/demo/demo.biom \
  AAM_MATRIX="$DEMO/unifrac.unweighted.h5" AAM_OUT="$WORK/single" AAM_CHECKPOINT_EVERY=2 AAM_ARGS="$ARGS"
[ -s "$WORK/single/checkpoints/best.safetensors" ] || fail "single: no best checkpoint"
grep -q "attention" "$WORK/single.out" || fail "single: the attention check did not run"

# Dropout and masking off: job 7 must end with this job's weights (the CPU backends draw them
# from one generator per process, which two replicas on threads of one process share).
DETERMINISTIC="$ARGS --dropout 0 --nuc-mask-ratio 0"
submit node pretrain_node.sh AAM_TABLE="$DEMO/demo.biom" AAM_MATRIX="$DEMO/unifrac.unweighted.h5" \
  AAM_OUT="$WORK/node" AAM_DEVICES=0,0 AAM_DIAGNOSE=0 AAM_ARGS="$DETERMINISTIC"
grep -q "data parallel: 2 replicas" "$WORK/node.out" || fail "node: not two replicas"
[ "$(wc -l < "$WORK/node/metrics.csv")" = 4 ] || fail "node: metrics.csv has not 3 epochs"

submit train train.sh AAM_TABLE="$DEMO/demo.biom" AAM_MATRIX="$DEMO/unifrac.unweighted.h5" \
  AAM_METADATA="$DEMO/demo_map.txt" AAM_COLUMN=age \
  AAM_PRETRAINED="$WORK/single/checkpoints/best.safetensors" AAM_OUT="$WORK/train" AAM_DIAGNOSE=0 \
  AAM_ARGS="--rarefy-depth 1000 --max-bp 100 --token-limit 256 --embedding-dim 64 --attention-layers 2 --epochs 2 --batch-size 8 --lr 5e-4"
[ -s "$WORK/train/checkpoints/best.safetensors" ] || fail "train: no best checkpoint"

submit predict predict.sh AAM_MODEL="$WORK/train/checkpoints/best.safetensors" \
  AAM_TABLE="$DEMO/demo.biom" AAM_OUTPUT="$WORK/predictions.tsv" AAM_DIAGNOSE=0
rows=$(($(wc -l < "$WORK/predictions.tsv") - 1))
[ "$rows" -gt 0 ] || fail "predict: no rows in predictions.tsv"
echo "     predictions.tsv: $rows samples"

submit unifrac unifrac.sh AAM_TABLE="$DEMO/demo.biom" AAM_TREE="$DEMO/tree.nwk" \
  AAM_OUTPUT="$WORK/unifrac.h5"
difference=$("$UNIFRAC_BENCH" compare "$WORK/unifrac.h5" "$DEMO/unifrac.unweighted.h5") \
  || fail "unifrac: $UNIFRAC_BENCH compare failed"
awk -v d="$difference" 'BEGIN { exit !(d < 1e-6) }' \
  || fail "unifrac: the matrix differs from the demo's ssu matrix by $difference"
echo "     unifrac.h5: within $difference of the demo's ssu matrix"

# 6. The time-limit warning: USR1 to the batch shell once the job has written a step checkpoint
# (what `#SBATCH --signal=B:USR1@300` does 300 s before the limit).
env AAM_TABLE="$DEMO/demo.biom" AAM_MATRIX="$DEMO/unifrac.unweighted.h5" AAM_OUT="$WORK/requeued" \
  AAM_CHECKPOINT_EVERY=2 AAM_DIAGNOSE=0 AAM_ARGS="$ARGS" \
  sbatch --parsable --gpus-per-node=0 --cpus-per-task=2 --job-name=aam-test-requeue \
  --output="$WORK/requeue.out" slurm/pretrain_single.sh > "$WORK/requeue.id"
job=$(cat "$WORK/requeue.id")
for _ in $(seq 600); do
  [ -f "$WORK/requeued/checkpoints/last.safetensors" ] && break
  sleep 0.5
done
[ -f "$WORK/requeued/checkpoints/last.safetensors" ] || fail "requeue: no checkpoint within 5 minutes"
scancel --batch --signal=USR1 "$job"
for _ in $(seq 900); do
  state=$(scontrol show job "$job" 2>/dev/null | grep -oE "JobState=[A-Z_]+" | cut -d= -f2 || true)
  restarts=$(scontrol show job "$job" 2>/dev/null | grep -oE "Restarts=[0-9]+" | cut -d= -f2 || true)
  case "$state" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
  sleep 1
done
[ "$state" = COMPLETED ] || fail "requeue: job $job ended $state"
[ "${restarts:-0}" -ge 1 ] || fail "requeue: job $job did not restart"
grep -q "stopped by SIGUSR1" "$WORK/requeue.out" || fail "requeue: aam-rs did not stop on the warning"
grep -q "requeueing job $job" "$WORK/requeue.out" || fail "requeue: the job did not requeue itself"
echo "ok   requeue: job $job got USR1, checkpointed, requeued, resumed ($restarts restart), $((SECONDS - started)) s"
python3 benches/compare_runs.py --tolerance 0 "$WORK/single" "$WORK/requeued" \
  || fail "requeue: the resumed job does not end as the uninterrupted one"

# 7. Several processes: pretrain_multi.sh's two tasks on the one node, one replica each.
SLURM_OVERRIDES="--nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --exclusive"
env AAM_TABLE="$DEMO/demo.biom" AAM_MATRIX="$DEMO/unifrac.unweighted.h5" AAM_OUT="$WORK/multi" \
  AAM_DEVICES=0 AAM_DIAGNOSE=0 AAM_ARGS="$DETERMINISTIC" \
  sbatch --wait --parsable --gpus-per-node=0 $SLURM_OVERRIDES --job-name=aam-test-multi \
  --output="$WORK/multi.out" slurm/pretrain_multi.sh > "$WORK/multi.id" \
  || fail "multi (pretrain_multi.sh) failed"
echo "ok   multi: pretrain_multi.sh, job $(cat "$WORK/multi.id"), $((SECONDS - started)) s"
grep -q "process 1 of 2" "$WORK/multi.out" || fail "multi: no second process"
grep -q "burn-collective" "$WORK/multi.out" || fail "multi: the processes did not sum with burn-collective"
python3 benches/compare_runs.py --tolerance 1e-5 "$WORK/node" "$WORK/multi" \
  || fail "multi: two processes do not end as two replicas in one process"
echo "all SLURM template checks passed in $((SECONDS - started)) s"
