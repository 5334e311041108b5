#!/usr/bin/env bash
# plugin_e2e.sh CASE KPL SOURCE_DIR AUTOENCODER_SO BAD_PLUGIN_DIR [KPLRUN] —
# tasks, models and optimizer rules from outside kpl, run by the stock
# `kpl train` with no rebuild of kpl:
#   plugin   examples/autoencoder.c built as a plugin: --keys lists its
#            model and optimizer, and its task's and model's own keys, whose
#            bad values are refused with file:line:key; `kpl train --plugin`
#            trains its task (a denoising autoencoder: task.autoencoder.noise) with
#            its model and its optimizer rule (Lion) to a reconstruction
#            error bound, and --resume continues bit for bit (Lion's state
#            and the noise's generator are in the checkpoint); the stock
#            kpl export writes its model (the task's export_output); a
#            recipe's `plugins:` path is relative to the recipe, printed at
#            start, resolved in --print-config
#   bad      a missing file, a library that is not a plugin, one built
#            against another kpl ABI, one registering a name kpl has: each
#            refused with exit 2 naming the file and what is wrong; a
#            recipe's bad plugin names the recipe's file and line
#   np2      2 ranks x 32 under kplrun with --plugin train as 1 rank x 64,
#            the same losses to 1e-4
set -euo pipefail
case_=$1 kpl=$2 src=$3 so=$4 bad=$5 kplrun=${6:-}
. "$(dirname "$0")/e2e_common.sh"
AE=$src/examples/autoencoder.yaml
R=("${QUIET[@]}" data.root="$tmp/fm" deterministic=true threads=1 data.workers=1 epochs=2
   data.train.limit=2560 data.val.limit=500 log.every_steps=1 optimizer.name=lion
   optimizer.lr=3e-3 "optimizer.betas=[0.9, 0.99]")

case $case_ in
plugin)
  need_fm
  "$kpl" train --keys --plugin "$so" > keys.txt
  grep -q '^  name: none  # .*\[mlp|lenet|cnn|resnet|fcos|deeplabv3|unet|dcgan|dcgan_d|sngan|sngan_d|autoencoder|none\]$' keys.txt || die "--keys: model.name: $(grep -m1 '^  name: none' keys.txt)"
  grep -q '^  name: sgd  # .*\[sgd|adam|adamw|lars|lion\]$' keys.txt || die "--keys: optimizer.name"
  # the plugin's own keys, in its task's and model's sections
  grep -A1 '^  autoencoder:  # task autoencoder.s own keys$' keys.txt | grep -q '^    noise: 0  # denoising: .* \[0, 1\]$' || die "--keys: task.autoencoder: $(grep -A1 '^  autoencoder:' keys.txt)"
  grep -A2 '^  autoencoder:  # model autoencoder.s own keys' keys.txt | grep -q '^    width: 16  # channels of the first convolution \[1, 1024\]$' || die "--keys: model.autoencoder"
  printf 'base: %s\nmodel:\n  autoencoder:\n    width: 0\n' "$AE" > badkey.yaml
  expect_usage_error "bad model key" "badkey.yaml:4:12: model.autoencoder.width: 0 is out of range [1, 1024]" train --plugin "$so" badkey.yaml "${R[@]}"
  printf 'base: %s\ntask:\n  autoencoder:\n    nois: 0.1\n' "$AE" > badkey.yaml
  expect_usage_error "misspelt task key" "badkey.yaml:4:5: unknown key 'task.autoencoder.nois' (task.autoencoder has: noise; did you mean 'noise'?)" train --plugin "$so" badkey.yaml "${R[@]}"
  expect_usage_error "bad task key" "override 'task.autoencoder.noise=loud': task.autoencoder.noise: expected a number, got 'loud'" train --plugin "$so" "$AE" "${R[@]}" task.autoencoder.noise=loud
  R+=(task.autoencoder.noise=0.1)
  # without the plugin, its names are unknown, named where they are
  expect_usage_error "no plugin" "autoencoder.yaml:1" train "$AE" "${R[@]}" run_dir=x
  grep -qE "task: unknown task 'autoencoder'|model.name: expected one of" err.txt || die "no plugin: $(cat err.txt)"
  # trained by the stock kpl: the example's task, model and optimizer rule
  "$kpl" train --plugin "$so" "$AE" "${R[@]}" run_dir=full > full.txt 2> full.err || die "train: $(tail -3 full.err)"
  grep -q "^plugins: .*libkpl_autoencoder.so$" full.txt || die "the plugin is not named at start: $(head -3 full.txt)"
  d=$(tail -n 1 full.txt)
  awk -v m="$(field val_mse "$d")" 'BEGIN { exit !(m > 0 && m < 0.06) }' || die "val mse with lion: $d"
  losses full > full.loss
  [[ $(wc -l < full.loss) == 40 ]] || die "steps: $(wc -l < full.loss)"
  awk 'NR == 1 { f = $2 } END { exit !($2 < f / 2) }' full.loss || die "the loss did not fall: $(sed -n '1p;$p' full.loss)"
  # stopped at step 25, resumed: Lion's exp_avg came back from the checkpoint
  "$kpl" train --plugin "$so" "$AE" "${R[@]}" run_dir=cut max_steps=25 > /dev/null 2> cut.err || die "cut: $(tail -3 cut.err)"
  "$kpl" train --plugin "$so" "$AE" "${R[@]}" run_dir=cut --resume > cut.txt 2> cut2.err || die "resume: $(tail -3 cut2.err)"
  losses cut | sort -n -k1,1 -u | diff - full.loss > /dev/null || die "resumed losses differ: $(losses cut | sort -n -u | diff - full.loss | head -4)"
  # the task names its inference graph's output (export_output), so the
  # stock kpl export writes the plugin's model, named as the task says
  ck=$(ls full/checkpoints/ckpt-*.kpl | sort | tail -n 1)
  "$kpl" export --plugin "$so" "$AE" "${R[@]}" --checkpoint "$ck" -o ae.kplm --batch 4 > exp.txt 2> exp.err \
    || die "export of the plugin's task: $(tail -3 exp.err)"
  grep -q '"event":"exported"' exp.txt && [[ -s ae.kplm ]] || die "export: $(cat exp.txt exp.err)"
  "$kpl" graph --plugin "$so" "$AE" "${R[@]}" --checkpoint "$ck" --level 0 > graph.txt 2> graph.err \
    || die "kpl graph of the plugin's task: $(tail -3 graph.err)"
  grep -q "reconstruction" graph.txt || die "the graph's output is not the task's name: $(grep -i output graph.txt | head -3)"
  # the recipe's own plugins: list, relative to the recipe's directory
  mkdir -p rc/lib
  cp "$so" rc/lib/
  printf 'base: %s\nplugins: [lib/%s]\n' "$AE" "$(basename "$so")" > rc/ae.yaml
  "$kpl" train rc/ae.yaml "${R[@]}" --print-config > cfg.yaml || die "--print-config with plugins:"
  grep -A2 '^  autoencoder:$' cfg.yaml | grep -q '^    noise: 0.1$' || die "--print-config: task.autoencoder: $(grep -A2 '^  autoencoder:$' cfg.yaml)"
  grep -q "^plugins: \[\"$tmp/rc/lib/$(basename "$so")\"\]$" cfg.yaml || die "--print-config: $(grep plugins cfg.yaml)"
  (cd rc && "$kpl" train ae.yaml "${R[@]}" max_steps=3 run_dir=r > r.txt 2> r.err) || die "plugins: in a recipe: $(tail -3 rc/r.err)"
  grep -q "^plugins: $tmp/rc/lib/" rc/r.txt || die "the recipe's plugin is not named: $(head -3 rc/r.txt)"
  # the run's config.yaml names the plugin, and runs again as it is
  "$kpl" train rc/r/config.yaml "${R[@]}" max_steps=1 run_dir=again > /dev/null 2> again.err || die "config.yaml: $(tail -3 again.err)"
  echo "plugin: trained with lion to $(field val_mse "$d"), resumed bit for bit"
  ;;

bad)
  expect_usage_error "missing" "kpl train: plugin nothere.so: cannot load: no such file" train --plugin nothere.so --keys
  echo "not a library" > junk.so
  expect_usage_error "junk" "plugin junk.so: cannot load: " train --plugin junk.so --keys
  grep -qi "elf\|invalid\|too short" err.txt || die "junk: dlerror's text missing: $(cat err.txt)"
  expect_usage_error "no abi" "plugin $bad/libplugin_none.so: not a kpl plugin (it defines no kpl_plugin_abi_version" \
    train --plugin "$bad/libplugin_none.so" --keys
  expect_usage_error "abi" "plugin $bad/libplugin_bad_abi.so was built against kpl ABI 999, this kpl is ABI " \
    train --plugin "$bad/libplugin_bad_abi.so" --keys
  expect_usage_error "dup" "task 'classification' is registered twice: by kpl itself and by plugin " \
    train --plugin "$bad/libplugin_dup.so" --keys
  # in a recipe: its file and line
  printf 'base: %s\nplugins:\n  - %s\n' "$src/recipes/fashion_mnist/cnn.yaml" "$bad/libplugin_bad_abi.so" > r.yaml
  expect_usage_error "recipe" "r.yaml:3:5: plugins: plugin $bad/libplugin_bad_abi.so was built against kpl ABI 999" train r.yaml --print-config
  printf 'base: %s\nplugins: {a: b}\n' "$src/recipes/fashion_mnist/cnn.yaml" > r2.yaml
  expect_usage_error "recipe map" "r2.yaml:2:10: plugins: expected a list of paths" train r2.yaml --print-config
  expect_usage_error "no path" "--plugin needs the path of a shared library" train --plugin
  echo "bad: 8 refusals named (test_plugin checks that nothing of them is kept)"
  ;;

np2)
  need_fm
  command -v mpirun > /dev/null || kpl_skip env "no mpirun"
  unset OMP_NUM_THREADS
  "$kpl" train --plugin "$so" "$AE" "${R[@]}" epochs=1 run_dir=one data.train.batch_size=64 > one.txt 2> one.err || die "1 rank: $(tail -3 one.err)"
  "$kplrun" -np 2 --log-dir logs -- "$kpl" train --plugin "$so" "$AE" "${R[@]}" epochs=1 run_dir=two \
    data.train.batch_size=32 > two.txt 2> two.err || die "2 ranks: $(tail -5 two.err)"
  losses one > one.loss
  losses two > two.loss
  [[ $(wc -l < one.loss) == 40 && $(wc -l < two.loss) == 40 ]] || die "steps: $(wc -l < one.loss) and $(wc -l < two.loss)"
  close_losses one.loss two.loss || die "2 ranks x 32 differ from 1 x 64"
  echo "np2: 2 ranks x 32 as 1 x 64 with the plugin's task, model and optimizer"
  ;;

*)
  die "unknown case"
  ;;
esac
