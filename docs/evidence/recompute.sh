#!/bin/sh
# Recomputes every table of docs/evidence.md from the records committed under docs/evidence/ (runs.csv and,
# where the study kept them, per-step metrics in steps.csv.gz), without a run folder: the 96-run study of
# 2026-12-02, its gate ablation on seeds 0-3 alone, the calibration of the collapse regime, the 48-run collapse
# study of issue 33, issue 40's re-reading of it (LLD rate on common steps), issue 40's calibration and its
# late-collapse study, issue 56's calibration at a good learning rate and its study; and issue 42's chain-vs-tree
# study, whose tables are in docs/tree-rollouts.md. Each report goes to its own folder under OUT (default
# /tmp/llds_jax_evidence); the .md files there are the committed ones byte for byte, and every table row of
# docs/evidence.md (and of the tree study in docs/tree-rollouts.md) is a row of one of them (tests/test_demo_study.py
# checks both). Run from the repository root: sh docs/evidence/recompute.sh [OUT]
# The interpreter is $PYTHON when set (a virtual environment that is not activated:
# PYTHON=/path/to/venv/bin/python sh docs/evidence/recompute.sh), else the first of python3 and python on PATH that
# imports llds_jax.
set -eu
OUT=${1:-/tmp/llds_jax_evidence}
if [ -z "${PYTHON:-}" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import llds_jax" >/dev/null 2>&1; then
            PYTHON=$candidate
            break
        fi
    done
fi
if [ -z "${PYTHON:-}" ] || ! "$PYTHON" -c "import llds_jax" >/dev/null 2>&1; then
    echo "recompute.sh: ${PYTHON:-no python3 or python on PATH} cannot import llds_jax; set PYTHON to the interpreter of the environment it is installed in (PYTHON=/path/to/venv/bin/python sh $0)" >&2
    exit 2
fi
EVIDENCE=docs/evidence
STUDY_ARMS=grpo,llds,llds_low_lr,grpo_low_lr,grpo_clip_higher,grpo_tis

"$PYTHON" -m llds_jax.apps.demo_study --settings stress,default,paper_shaped --seeds 8 \
    --arms grpo,llds,grpo_low_lr:4,grpo_kl10:4,llds_token:4,llds_response:4 --out "$OUT/study_2026_12_02" \
    --report --recorded "$EVIDENCE/runs.csv"
"$PYTHON" -m llds_jax.apps.demo_study --settings stress,default,paper_shaped --seeds 4 \
    --arms grpo,llds,llds_token,llds_response --out "$OUT/gates_seeds_0_3" --controls grpo \
    --report --recorded "$EVIDENCE/runs.csv"
"$PYTHON" -m llds_jax.apps.demo_study --settings lr1e3=configs/demo_cpu_grpo.py --seeds 0-1 --arms grpo \
    --out "$OUT/collapse_calibration" --report --recorded "$EVIDENCE/collapse/calibration/runs.csv" \
    -- --config.optim.learning_rate=1e-3 --config.train.total_steps=40
"$PYTHON" -m llds_jax.apps.demo_study --settings collapse --seeds 2-9 --arms "$STUDY_ARMS" \
    --out "$OUT/collapse_study" --report --recorded "$EVIDENCE/collapse/study/runs.csv" \
    --controls grpo --endpoints collapsed,final_em,lld_rate_mean
# Issue 40's re-reading of the collapse study (not pre-registered): each run's mean LLD rate over the steps both
# runs of a pair logged one, a family of its own.
"$PYTHON" -m llds_jax.apps.demo_study --settings collapse --seeds 2-9 --arms "$STUDY_ARMS" \
    --out "$OUT/collapse_study_common_steps" --report --recorded "$EVIDENCE/collapse/study/runs.csv" \
    --controls grpo --endpoints lld_rate_common
# Issue 40's calibration of a learn-then-collapse regime (GRPO, four learning rates, 60 steps, seeds 0-3).
S=configs/demo_cpu_late_collapse.py
"$PYTHON" -m llds_jax.apps.demo_study --settings "lr5e4=$S:5e-4,lr6e4=$S:6e-4,lr7e4=$S:7e-4,lr8e4=$S:8e-4" \
    --seeds 0-3 --arms grpo --out "$OUT/late_collapse_calibration" --report \
    --recorded "$EVIDENCE/late_collapse/calibration/runs.csv"
# Issue 40's pre-registered late-collapse study (80 steps, seeds 4-11, five arms).
"$PYTHON" -m llds_jax.apps.demo_study --settings late_collapse --seeds 4-11 \
    --arms grpo,llds,llds_lam1,grpo_low_lr,grpo_clip_higher --out "$OUT/late_collapse_study" --report \
    --recorded "$EVIDENCE/late_collapse/study/runs.csv" --controls grpo \
    --endpoints collapsed,final_em,peak_em,lld_rate_common
# Issue 56's calibration at a good learning rate (GRPO at lr 2e-4, 200 steps, seeds 0-3).
"$PYTHON" -m llds_jax.apps.demo_study --settings long_lr2e4=configs/demo_cpu_long_horizon.py:2e-4 --seeds 0-3 \
    --arms grpo --out "$OUT/long_horizon_calibration" --report \
    --recorded "$EVIDENCE/long_horizon/calibration/runs.csv"
# Issue 42's pre-registered chain-vs-tree study (docs/tree-rollouts.md; 20 steps, seeds 1-8, four arms with LLDS).
"$PYTHON" -m llds_jax.apps.demo_study --settings tree_study --seeds 1-8 \
    --arms llds,llds_trees,llds_trees_wide,llds_trees_quarter --out "$OUT/tree_study" --report \
    --recorded "$EVIDENCE/tree_study/runs.csv" --controls llds \
    --endpoints final_em,peak_em,tokens_generated,searches_per_trajectory,step_s,collapsed
# Issue 59's registered comparison of synchronous and partial rollouts (docs/evidence.md; 20 steps, seeds 0-7, two
# arms).
"$PYTHON" -m llds_jax.apps.demo_study --settings stress --arms sync_tis,partial2 --seeds 8 \
    --out "$OUT/partial_study" --report --recorded "$EVIDENCE/partial_study/runs.csv" \
    --controls sync_tis --primary final_em --endpoints step_s,rollout_s,tokens_per_s
# Issue 56's pre-registered good-learning-rate study (docs/evidence.md; 200 steps, seeds 4-19, two arms).
"$PYTHON" -m llds_jax.apps.demo_study --settings good_lr --seeds 4-19 --arms grpo,llds --out "$OUT/good_lr_study" \
    --report --recorded "$EVIDENCE/good_lr/study/runs.csv" --controls grpo --primary last3_em --margin 0.02 \
    --endpoints lasting_collapse,lasting_decline,last3_two_hop_em,peak_em,lld_rate_common
