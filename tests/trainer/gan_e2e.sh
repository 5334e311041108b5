#!/usr/bin/env bash
# gan_e2e.sh CASE KPL SOURCE_DIR [KPLRUN] — the gan task end to end on
# Fashion-MNIST (and generated CIFAR files), one CTest test per case:
#   dcgan   the DCGAN recipe, narrowed and short, with a small feature
#           network (kpl data fid-net, one epoch): FID measured before
#           training (eval.at_start) and after 300 steps; it must fall by
#           half (350 -> 125 measured, falling every epoch); the
#           sample grid is a 242 x 242 PNG in the run directory and a
#           TensorBoard image; kpl eval of the last checkpoint gives the
#           training's last FID and IS exactly
#   np2     2 ranks x 8 train as 1 rank x 16 (WGAN-GP with its double
#           backward, SyncBN in the generator, layer norm in the critic,
#           2 critic steps per generator step): the same losses at every
#           step to 1e-4 and the same FID
#   resume  a run stopped at step 6 and resumed to 12 ends as one that ran
#           12 steps straight: the same losses and FID, to the digit
#   sngan   the SNGAN CIFAR-10 recipe, unchanged but for its width, data
#           and length, on generated CIFAR-10 python files: hinge loss,
#           spectral norm (its u, v in the checkpoint: kpl eval scores
#           as the run did), 5 D steps per
#           G step, a 10 x 10 grid of 32 x 32 colour samples
#   errors  a generator without latent_dim, an unknown discriminator,
#           gradient accumulation, a bad grid, a corrupt feature network,
#           a missing one (the run ends at its start, naming the `kpl data
#           fid-net` command that makes it): clear errors, exit 1 or 2;
#           kpl data fid-net on a file it made: described, not trained
set -euo pipefail
case_=$1 kpl=$2 src=$3 kplrun=${4:-}
. "$(dirname "$0")/e2e_common.sh"
recipe=$src/recipes/gan/dcgan_fmnist.yaml
# the (step, figure) pairs of a run's train records
figs() { sed -n 's/^{"event":"train","step":\([0-9]*\),.*"'"$2"'":\([^,}]*\).*/\1 \2/p' "$1/metrics.jsonl"; }
# a PNG's width and height (its IHDR)
png_size() { od -An -tu1 -j16 -N8 "$1" | awk '{ print $1*16777216+$2*65536+$3*256+$4, $5*16777216+$6*65536+$7*256+$8 }'; }
# a small stand-in feature network (the default recipe, one epoch on 6000 images)
fid_net() {
  "$kpl" data fid-net --recipe "$src/recipes/fashion_mnist/cnn.yaml" -o "$tmp/fid.kpl" epochs=1 data.train.limit=6000 "${QUIET[@]}" \
    > fidnet.txt 2> fidnet.err || die "fid-net: $(tail -5 fidnet.err)"
}
FID=(task.gan.fid_network="$tmp/fid.kpl" task.gan.fid_recipe="$src/recipes/fashion_mnist/cnn.yaml")

case $case_ in
dcgan)
  need_fm
  fid_net
  G=("$recipe" "${QUIET[@]}" "${FID[@]}" model.width=32 data.train.limit=3200 data.val.limit=1000
     task.gan.fid_samples=1000 deterministic=true)
  "$kpl" train "${G[@]}" run_dir=run epochs=6 eval.every_epochs=3 eval.at_start=true > train.txt 2> train.err \
    || die "train: $(tail -5 train.err)"
  done_line=$(tail -n 1 train.txt)
  echo "dcgan: $done_line"
  [[ $(field event "$done_line") == done ]] || die "no done line: $done_line"
  grep -q '^before training: val d_real [-0-9.]* fid [0-9.]* is ' train.txt \
    || die "no evaluation before training: $(head -5 train.txt)"
  f0=$(field val_fid "$(grep '"event":"eval"' run/metrics.jsonl | head -n 1)")
  f1=$(field val_fid "$done_line")
  echo "FID untrained $f0, after 300 steps $f1"
  awk -v a="$f0" -v b="$f1" 'BEGIN { exit !(b > 0 && b < a / 2) }' || die "FID $f0 -> $f1: not halved"
  is=$(field val_is "$done_line")
  awk -v x="$is" 'BEGIN { exit !(x >= 1 && x <= 10) }' || die "IS $is outside [1, 10]"
  for f in loss_d loss_g d_real d_fake; do
    [[ -n $(field "train_$f" "$done_line") ]] || die "no train_$f: $done_line"
  done
  # the grid: 8 x 8 samples of 28 x 28, 2 pixels apart, at steps 0, 150, 300
  png=$(ls run/samples/step_*.png | tail -n 1)
  [[ $(ls run/samples/step_*.png | wc -l) == 3 ]] || die "grids: $(ls run/samples)"
  [[ $(png_size "$png") == "242 242" ]] || die "grid size $(png_size "$png")"
  ev_file=$(ls run/tb/events.out.tfevents.*)
  grep -aq 'val/samples' "$ev_file" || die "no TensorBoard sample image"
  grep -aq 'val/fid' "$ev_file" || die "no TensorBoard FID"
  # the same figures from kpl eval of the last checkpoint
  ck=$(ls run/checkpoints/ckpt-*.kpl | tail -n 1)
  "$kpl" eval "${G[@]}" --checkpoint "$ck" > eval.txt 2> eval.err || die "eval: $(tail -5 eval.err)"
  ev=$(tail -n 1 eval.txt)
  for f in val_fid val_is val_d_real; do
    [[ $(field $f "$ev") == $(field $f "$done_line") ]] \
      || die "kpl eval's $f $(field $f "$ev") vs training's $(field $f "$done_line")"
  done
  ;;

np2)
  [[ -x $kplrun ]] || kpl_skip env "no kplrun"
  command -v mpirun > /dev/null || kpl_skip env "no mpirun"
  need_fm
  fid_net
  # One thread per rank on both sides keeps the summation orders alike.
  R=("$src/recipes/gan/wgangp_fmnist.yaml" "${QUIET[@]}" "${FID[@]}" model.width=16
     model.sync_bn=true task.gan.n_critic=2 task.gan.fid_samples=500 data.val.limit=500
     deterministic=true threads=1 max_steps=10 log.every_steps=1)
  "$kpl" train "${R[@]}" run_dir=one data.train.batch_size=16 > one.txt 2> one.err \
    || die "1 rank: $(tail -3 one.err)"
  "$kplrun" -np 2 -- "$kpl" train "${R[@]}" run_dir=two data.train.batch_size=8 > two.txt 2> two.err \
    || die "2 ranks: $(tail -5 two.err)"
  grep -q 'model.sync_bn: [0-9]* batch norms of generator synchronised over 2 ranks' two.txt \
    || die "no SyncBN line: $(head -8 two.txt)"
  for f in loss_d gp d_real; do
    figs one $f > one.$f
    figs two $f > two.$f
    [[ $(wc -l < one.$f) == 10 ]] || die "$f: $(wc -l < one.$f) steps, want 10"
    close_losses one.$f two.$f || die "$f: 2 ranks x 8 differ from 1 x 16"
  done
  figs one loss_g | grep -v null > one.loss_g
  figs two loss_g | grep -v null > two.loss_g
  [[ $(wc -l < one.loss_g) == 5 ]] || die "loss_g: $(wc -l < one.loss_g) generator steps, want 5"
  close_losses one.loss_g two.loss_g || die "loss_g: 2 ranks x 8 differ from 1 x 16"
  a=$(tail -n 1 one.txt) b=$(tail -n 1 two.txt | sed 's/^\[r0\] //')
  [[ $(field ranks "$b") == 2 ]] || die "ranks: $b"
  awk -v x="$(field val_fid "$a")" -v y="$(field val_fid "$b")" \
    'BEGIN { d = (x - y) / x; exit !(d <= 1e-3 && d >= -1e-3) }' \
    || die "FID $(field val_fid "$a") (1 rank) vs $(field val_fid "$b") (2 ranks)"
  ;;

resume)
  need_fm
  fid_net
  G=("$recipe" "${QUIET[@]}" "${FID[@]}" model.width=16 task.gan.fid_samples=500
     data.val.limit=500 deterministic=true log.every_steps=1 'task.gan.grid=[2, 3]')
  "$kpl" train "${G[@]}" run_dir=whole max_steps=12 > whole.txt 2> whole.err \
    || die "whole: $(tail -3 whole.err)"
  "$kpl" train "${G[@]}" run_dir=cut max_steps=6 > cut1.txt 2> cut1.err || die "cut: $(tail -3 cut1.err)"
  "$kpl" train "${G[@]}" run_dir=cut max_steps=12 --resume > cut2.txt 2> cut2.err \
    || die "resume: $(tail -3 cut2.err)"
  for f in loss_d loss_g d_fake; do
    figs whole $f | tail -n 6 > w.$f
    figs cut $f | tail -n 6 > c.$f
    [[ $(head -c 2 c.$f) == "7 " ]] || die "resumed $f: $(cat c.$f)"
    cmp -s w.$f c.$f || die "$f after resuming: $(paste w.$f c.$f)"
  done
  a=$(tail -n 1 whole.txt) b=$(tail -n 1 cut2.txt)
  [[ $(field val_fid "$a") == $(field val_fid "$b") ]] || die "FID $(field val_fid "$a") vs $(field val_fid "$b")"
  [[ $(png_size whole/samples/step_00000012.png) == "92 62" ]] \
    || die "a 2 x 3 grid: $(png_size whole/samples/step_00000012.png)"
  cmp -s whole/samples/step_00000012.png cut/samples/step_00000012.png || die "the grids differ"
  ;;

sngan)
  [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import numpy' 2> /dev/null \
    || kpl_skip ref "numpy for /usr/bin/python3"
  # 25 training and 9 test images, pickled as Python 2 wrote the download
  /usr/bin/python3 "$src/tests/dataio/gen_cifar.py" gc 4 > gen.txt 2>&1 || die "gen_cifar: $(cat gen.txt)"
  S=("$src/recipes/gan/sngan_cifar10.yaml" "${QUIET[@]}" data.root="$tmp/d"
     data.convert.source="$tmp/gc/c10py2/cifar-10-batches-py" data.workers=1
     model.sngan.g_width=32 model.sngan.d_width=32 data.train.batch_size=8 data.val.batch_size=20
     max_steps=10 log.every_steps=5 deterministic=true)
  "$kpl" train "${S[@]}" run_dir=run > train.txt 2> train.err || die "sngan: $(tail -5 train.err)"
  done_line=$(tail -n 1 train.txt)
  echo "sngan: $done_line"
  [[ $(field steps "$done_line") == 10 ]] || die "steps: $done_line"
  figs run loss_g | grep -v null > g.txt || true
  [[ $(wc -l < g.txt) == 2 ]] || die "loss_g at $(cat g.txt): want steps 5 and 10 (n_critic 5)"
  [[ -n $(field val_d_real "$done_line") && -z $(field val_fid "$done_line") ]] \
    || die "evaluation (no FID without a feature network): $done_line"
  [[ $(png_size run/samples/step_00000010.png) == "342 342" ]] \
    || die "a 10 x 10 grid of 32 x 32: $(png_size run/samples/step_00000010.png)"
  grep -q 'sngan (' train.txt && grep -q 'sngan_d (' train.txt || die "models: $(head -3 train.txt)"
  ck=run/checkpoints/ckpt-0000000010.kpl
  # evaluation uses the stored u and v of every spectral norm: kpl eval
  # of the checkpoint scores the validation images as the run did
  "$kpl" eval "${S[@]}" --checkpoint "$ck" > eval.txt 2> eval.err || die "eval: $(tail -5 eval.err)"
  [[ $(field val_d_real "$(tail -n 1 eval.txt)") == $(field val_d_real "$done_line") ]] \
    || die "kpl eval: $(tail -n 1 eval.txt) vs $done_line"
  ;;

errors)
  need_fm
  # expect_fail WHAT NEEDLE ARGS...: kpl train fails (exit 1 or 2) saying NEEDLE
  expect_fail() {
    local what=$1 needle=$2 rc=0
    shift 2
    timeout 300 "$kpl" train "$recipe" "${QUIET[@]}" task.gan.fid_network= data.train.limit=256 \
      max_steps=2 "$@" > out.txt 2> err.txt || rc=$?
    [[ $rc == 1 || $rc == 2 ]] || die "$what: exit $rc ($(tail -3 err.txt))"
    grep -qF -- "$needle" err.txt || die "$what: '$(tail -3 err.txt)' lacks '$needle'"
  }
  # kpl data fid-net's overrides hold for the network it then checks and
  # describes: a narrower hidden layer (64 features), data somewhere else
  "$kpl" data fid-net --recipe "$src/recipes/fashion_mnist/cnn.yaml" -o fid64.kpl epochs=1 \
    data.train.limit=640 'model.hidden=[64]' data.root="$tmp/fm64" "${QUIET[@]}" > f64.txt \
    2> f64.err || die "fid-net with overrides: $(tail -3 f64.err)"
  grep -q '"dim":64,' f64.txt || die "fid-net with overrides: $(cat f64.txt)"
  # again: the file is there, so it is described, not trained again
  "$kpl" data fid-net --recipe "$src/recipes/fashion_mnist/cnn.yaml" -o fid64.kpl \
    'model.hidden=[64]' data.root="$tmp/fm64" > f64b.txt 2> f64b.err \
    || die "fid-net again: $(tail -3 f64b.err)"
  grep -q '"existed":true,"dim":64,' f64b.txt && ! grep -q 'fid: training' f64b.err \
    || die "fid-net on its own file: $(cat f64b.txt f64b.err)"
  # the task loads the file, never makes it: a missing one ends the run at
  # its start, before any step, naming the command that makes it
  expect_fail "a missing feature network" "task.gan.fid_network: data/fid/fmnist_cnn.kpl does not \
exist: make it with 'kpl data fid-net --recipe recipes/fashion_mnist/cnn.yaml -o \
data/fid/fmnist_cnn.kpl' (or set task.gan.fid_network= to train without FID)" \
    task.gan.fid_network=data/fid/fmnist_cnn.kpl task.gan.fid_recipe=recipes/fashion_mnist/cnn.yaml \
    run_dir=r6
  [[ ! -e data/fid && -z $(ls -A r6/checkpoints 2> /dev/null) ]] \
    || die "a missing feature network: $(ls -R data/fid r6/checkpoints)"
  ! grep -q '"event":"train"' r6/metrics.jsonl 2> /dev/null || die "a missing feature network: it trained"
  # a classifier as the generator (the recipe without its dcgan keys)
  sed '/^  dcgan:/,/^    d_norm/d' "$recipe" > cnn.yaml
  rc=0
  "$kpl" train cnn.yaml "${QUIET[@]}" model.name=cnn model.num_classes=10 run_dir=r0 > out.txt 2> err.txt || rc=$?
  [[ $rc == 1 || $rc == 2 ]] && grep -qF "declares no latent_dim key" err.txt \
    || die "a classifier as generator: exit $rc ($(tail -3 err.txt))"
  expect_fail "unknown discriminator" "task.gan.discriminator: no zoo model 'nosuch'" \
    task.gan.discriminator=nosuch run_dir=r1
  expect_fail "accumulate" "optimizer.accumulate 2: the gan task's models step in turn" \
    optimizer.accumulate=2 run_dir=r2
  # the task's rules joining keys: exit 2 at load, naming where and the key
  expect_usage_error "grid" "override 'task.gan.grid=[3]': task.gan.grid: want [rows, columns], got 1 values" \
    train "$recipe" 'task.gan.grid=[3]' run_dir=r3
  expect_usage_error "d_betas" "task.gan.d_betas: want [] or [beta1, beta2], got 1 values" \
    train "$recipe" 'task.gan.d_betas=[0.5]' run_dir=r3
  expect_usage_error "fid_samples" "task.gan.fid_samples: 2 is fewer than task.gan.is_splits 10" \
    train "$recipe" task.gan.fid_samples=2 run_dir=r3
  expect_usage_error "a generator as discriminator" \
    "task.gan.discriminator: 'dcgan' is model.name, the generator" \
    train "$recipe" task.gan.discriminator=dcgan run_dir=r3
  [[ ! -e r3 ]] || die "a refused recipe made a run directory"
  # a model file (kpl export) as the feature network: said so
  "$kpl" export "$src/recipes/fashion_mnist/cnn.yaml" 'model.hidden=[64]' data.root="$tmp/fm64" \
    "${QUIET[@]}" --checkpoint fid64.kpl -o fid64.kplm > /dev/null 2> exp.err || die "export: $(cat exp.err)"
  expect_fail "a model file as feature network" \
    "task.gan.fid_network: feature network: $tmp/fid64.kplm: a model file (kpl export), not a checkpoint" \
    task.gan.fid_network="$tmp/fid64.kplm" task.gan.fid_recipe="$src/recipes/fashion_mnist/cnn.yaml" run_dir=r5
  head -c 3000 /dev/urandom > bad.kpl
  expect_fail "corrupt feature network" "bad.kpl" task.gan.fid_network="$tmp/bad.kpl" \
    task.gan.fid_recipe="$src/recipes/fashion_mnist/cnn.yaml" run_dir=r4
  expect_usage_error "loss choice" "task.gan.loss" train "$recipe" task.gan.loss=focal
  expect_usage_error "unknown key" "task.gan.n_critics" train "$recipe" task.gan.n_critics=3
  ;;

*) die "unknown case" ;;
esac
echo "PASS ($case_)"
