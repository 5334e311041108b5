#!/usr/bin/env bash
# export_e2e.sh CASE KPL SOURCE_DIR [EXAMPLE] — kpl export, kpl infer and kpl
# graph end to end, one CTest test per case:
#   cnn       the default recipe trained briefly, exported (O3, fused):
#             kpl infer on the test split gives kpl eval's top-1 (within
#             one example: folded batch norm rounds otherwise); images as PNG files give the split's outputs to
#             the printed digit, and so do they through the C inference
#             API's example (examples/classify_image.c); a bad image is
#             named and skipped (exit 1)
#             while the others are printed; the graph dumps (text, dot)
#             show the fused convolutions; every level (0-3) of the same
#             model gives the same lines
#   resnet18  the ResNet-18 recipe (residual adds, batch norm, adaptive
#             pooling) a few steps in, exported at batch 8: kpl infer's
#             top-1 on 256 test images is kpl eval's (within one example)
#   onnx      the default cnn, LeNet, ResNet-18 (its residual adds fused
#             into the convolutions) and a small U-Net (transposed
#             convolutions: ConvTranspose) exported as ONNX (opset
#             13): the ONNX checker accepts each, and onnxruntime on a
#             random batch gives kpl infer's outputs (of the same
#             checkpoint's .kplm) to 1e-4 (onnx_check.py; skipped without
#             onnx and onnxruntime); a graph with an op ONNX has no form
#             for here is refused naming it
#   import    kpl import onnx of torchvision ResNet-18 initializers (raw,
#             typed and external data; torchvision_onnx.py): every tensor of
#             kpl's resnet18 found by name (--check; test_model_file checks
#             the values of a round trip), a cut tensor, data outside the
#             model's directory (by its location or through a symbolic
#             link), a NaN and a file whose batch norm torch's eval-mode
#             export folded (onnx::Conv_N names) refused naming them; then model.weights starts a ResNet-18 run from
#             them (--exclude conv1.* fc.*: the CIFAR stem and 10 classes),
#             logged, and the first loss differs from a run without
#   torch     torchvision's ResNet-18/50 (random weights): kpl import torch
#             of the .pth (also wrapped as training scripts save it) and
#             kpl import onnx of a training-mode export give torch's logits
#             through kpl export + kpl infer (1e-4, 1e-5); an eval-mode
#             export (batch norm folded) is refused; model.weights
#             fine-tunes from the import
#   errors    a truncated model file, a flipped byte, a checkpoint given as
#             a model, a task with no inference graph, missing arguments,
#             .npy files with a bad shape (negative, not integers) or a size
#             that does not match it: each a clear error and a non-zero
#             exit, nothing left behind; NaN outputs as JSON null, exit 1
set -euo pipefail
case_=$1 kpl=$2 src=$3 example=${4:-} gen=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
. "$(dirname "$0")/e2e_common.sh"
need_fm
FM=(data.root="$tmp/fm" "${QUIET[@]}")

# train_short RECIPE STEPS LIMIT: a run in ./run, its done line in done.txt
train_short() {
  "$kpl" train "$1" "${FM[@]}" deterministic=true run_dir=run max_steps="$2" data.val.limit="$3" > train.txt \
    2> train.err || die "train: $(tail -5 train.err)"
  tail -n 1 train.txt > done.txt
}
# write_png OUT.png EXAMPLE: test image EXAMPLE of Fashion-MNIST as a PNG
# (python's zlib; the caller skips without python)
write_png() {
  /usr/bin/python3 - "$1" "$2" "$fm/t10k-images-idx3-ubyte.gz" <<'EOF'
import gzip, struct, sys, zlib
out, k, src = sys.argv[1], int(sys.argv[2]), sys.argv[3]
d = gzip.open(src).read()[16 + 784 * k:16 + 784 * (k + 1)]
raw = b"".join(b"\0" + d[r * 28:(r + 1) * 28] for r in range(28))
def chunk(t, b):
    return struct.pack(">I", len(b)) + t + b + struct.pack(">I", zlib.crc32(t + b) & 0xffffffff)
open(out, "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 28, 28, 8, 0, 0, 0, 0))
                      + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
EOF
}

case $case_ in
cnn)
  recipe=$src/recipes/fashion_mnist/cnn.yaml
  train_short "$recipe" 120 1000
  ck=run/checkpoints/ckpt-0000000120.kpl
  want=$(field val_top1 "$(cat done.txt)")
  "$kpl" export "$recipe" "${FM[@]}" --checkpoint $ck -o m.kplm --batch 32 > exp.txt 2> exp.err \
    || die "export: $(cat exp.err)"
  [[ $(field event "$(tail -n 1 exp.txt)") == exported ]] || die "export line: $(cat exp.txt)"
  [[ ! -e m.kplm.tmp && ! -e m.kplm.done ]] || die "export left m.kplm.tmp or a marker"
  "$kpl" infer m.kplm fm/test --limit 1000 --top 3 > inf.txt 2> inf.err || die "infer: $(cat inf.err)"
  last=$(tail -n 1 inf.txt)
  [[ $(field examples "$last") == 1000 && $(field labelled "$last") == 1000 ]] || die "done: $last"
  got=$(field top1 "$last")
  # the fused graph rounds differently (batch norm folded into the weights):
  # one example in 1000 may fall the other way
  awk -v a="$got" -v b="$want" 'BEGIN { d = a - b; exit !(d < 0.11 && d > -0.11) }' \
    || die "kpl infer top-1 $got, kpl eval $want"
  [[ $(grep -c '"top":\[{"class":[0-9]*,"prob":[0-9.e-]*},{' inf.txt) == 1000 ]] || die "top-3 lines"
  # every level runs the same kernels on the same values: the same lines
  for lv in 0 1 2; do
    "$kpl" infer m.kplm fm/test --limit 200 --top 3 --level $lv > lv$lv.txt || die "infer --level $lv"
    head -n 200 lv$lv.txt | cmp -s - <(head -n 200 inf.txt) || die "level $lv differs from 3"
  done
  # image files: the split's outputs, and a bad one named and skipped
  if [[ -x /usr/bin/python3 ]]; then
    for k in 0 1 2; do write_png img$k.png $k; done
    echo "not an image" > bad.png
    set +e
    "$kpl" infer m.kplm img0.png bad.png img1.png img2.png --top 3 > png.txt 2> png.err
    rc=$?
    set -e
    [[ $rc == 1 ]] || die "a bad image: exit $rc, expected 1"
    grep -q "skipped bad.png: .*neither JPEG nor PNG" png.err || die "bad image message: $(cat png.err)"
    for k in 0 1 2; do
      a=$(grep "\"input\":\"img$k.png\"" png.txt | sed 's/.*"top"://')
      b=$(sed -n "$((k + 1))p" inf.txt | sed 's/.*"top"://')
      [[ -n $a && $a == "$b" ]] || die "img$k.png: $a, the split's example $k: $b"
      if [[ -n $example ]]; then # the C API: the best class and its probability
        c=$(sed -n 's/^\[{"class":\([0-9]*\),"prob":\([0-9.e-]*\)}.*/\1 \2/p' <<<"$a")
        line=$("$example" m.kplm img$k.png) || die "the example on img$k.png"
        awk -v l="$line" -v c="$c" 'BEGIN { split(c, w, " "); n = split(l, f, "[ =)]+")
             exit !(f[3] == w[1] && (f[n - 1] - w[2])^2 < 1e-8) }' || die "example: '$line', kpl infer: $c"
      fi
    done
  else
    kpl_skip_note ref "/usr/bin/python3 (the PNG check)"
  fi
  # graph dumps: traced, then fused (batch norm folded, no rsqrt left)
  "$kpl" graph "$recipe" "${FM[@]}" --checkpoint $ck > g.txt 2> g.err || die "graph: $(cat g.err)"
  grep -q '^# traced' g.txt && grep -q '^# after the passes of O3' g.txt || die "graph headers"
  after=$(sed -n '/^# after/,$p' g.txt)
  grep -q "rsqrt(" <<<"$(sed -n '1,/^# after/p' g.txt)" || die "the traced graph lacks batch norm's rsqrt"
  ! grep -q "rsqrt(" <<<"$after" || die "batch norm was not folded"
  grep -q "= conv2d(%0:image" <<<"$after" || die "no convolution of the input after the passes"
  "$kpl" graph m.kplm --dot > g.dot || die "graph --dot"
  head -n 1 g.dot | grep -q '^digraph kpl {' && grep -q -- '-> out0;' g.dot || die "dot output"
  ;;
resnet18)
  recipe=$src/recipes/fashion_mnist/resnet18.yaml
  train_short "$recipe" 6 256
  want=$(field val_top1 "$(cat done.txt)")
  "$kpl" export "$recipe" "${FM[@]}" --checkpoint run/checkpoints/ckpt-0000000006.kpl -o r.kplm \
    --batch 8 > exp.txt 2> exp.err || die "export: $(cat exp.err)"
  "$kpl" infer r.kplm fm/test --limit 256 > inf.txt || die "infer"
  got=$(field top1 "$(tail -n 1 inf.txt)")
  awk -v a="$got" -v b="$want" 'BEGIN { d = a - b; exit !(d < 0.4 && d > -0.4) }' \
    || die "kpl infer top-1 $got, kpl eval $want (one example in 256 may differ)"
  ;;
onnx)
  [[ -x /usr/bin/python3 ]] || kpl_skip ref "/usr/bin/python3"
  /usr/bin/python3 -c 'import onnx, onnxruntime' 2> /dev/null \
    || kpl_skip ref "onnx/onnxruntime for /usr/bin/python3"
  for m in cnn lenet resnet18; do
    mkdir -p $m && cd $m
    train_short "$src/recipes/fashion_mnist/$m.yaml" 4 64
    ck=run/checkpoints/ckpt-0000000004.kpl
    for f in kplm onnx; do
      "$kpl" export "$src/recipes/fashion_mnist/$m.yaml" "${FM[@]}" \
        --checkpoint $ck -o m.$f --format $f --batch 3 > exp.txt 2> exp.err \
        || die "$m: export --format $f: $(cat exp.err)"
    done
    /usr/bin/python3 "$here/onnx_check.py" "$kpl" m.kplm m.onnx . || die "$m: onnx_check"
    cd ..
  done
  # a small U-Net, whose transposed convolutions export as ConvTranspose,
  # on a small fmnist-seg set; its validation transform made one size
  # (center crop), as a graph has one input shape
  mkdir -p unet && cd unet
  "$kpl" data synth fmnist-seg d --train 32 --val 8 --size 64 --sides 40 56 --objects 1 \
    --seed 3 --quiet > synth.txt || die "unet: synth"
  sed -e 's/^      crop: keep_ratio$/      crop: center\n      resize_shorter: 64/' \
    -e '/^      short_sides: \[0\]$/d' -e 's/^      max_side: 128$/      size: [64, 64]/' \
    "$src/recipes/segmentation/unet_fmnistseg.yaml" > unet.yaml
  grep -q 'crop: center' unet.yaml || die "unet: the recipe's validation transform changed"
  U=(data.root="$PWD/d" data.convert.source="$PWD/d" 'data.train.transform.size=[64, 64]'
     model.width=8 model.depth=3 "${QUIET[@]}")
  "$kpl" train unet.yaml "${U[@]}" deterministic=true run_dir=run max_steps=2 > train.txt \
    2> train.err || die "unet: train: $(tail -5 train.err)"
  for f in kplm onnx; do
    "$kpl" export unet.yaml "${U[@]}" --checkpoint run/checkpoints/ckpt-0000000002.kpl \
      -o m.$f --format $f --batch 2 > exp.txt 2> exp.err || die "unet: export --format $f: $(cat exp.err)"
  done
  /usr/bin/python3 "$here/onnx_check.py" "$kpl" m.kplm m.onnx . > check.txt || die "unet: onnx_check"
  cat check.txt
  grep -q "ConvTranspose" m.onnx || die "unet: no ConvTranspose in the export"
  cd ..
  ;;
import)
  [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c "import onnx" 2> /dev/null \
    || kpl_skip ref "python3 with onnx"
  for kind in plain external; do
    /usr/bin/python3 "$here/torchvision_onnx.py" r18_$kind.onnx $kind > sum_$kind.txt || die "python $kind"
    "$kpl" import onnx r18_$kind.onnx -o w_$kind.kpl --check resnet18 --classes 1000 > imp.txt 2> imp.err \
      || die "import $kind: $(cat imp.err)"
    grep -q '"loaded":102,"missing":0,"unexpected":20' imp.txt || die "import $kind: $(cat imp.txt imp.err)"
    grep -q 'num_batches_tracked' imp.err || die "import $kind: the unexpected tensors are not named"
    [[ -f w_$kind.kpl ]] || die "import $kind wrote no checkpoint"
  done
  /usr/bin/python3 "$here/torchvision_onnx.py" cut.onnx badraw > /dev/null || die "python badraw"
  if "$kpl" import onnx cut.onnx -o cut.kpl 2> err.txt; then die "a cut tensor was imported"; fi
  grep -q "layer2.0.conv1.weight" err.txt || die "the cut tensor is not named: $(cat err.txt)"
  [[ ! -e cut.kpl ]] || die "a failed import left cut.kpl"
  mkdir -p sub && /usr/bin/python3 "$here/torchvision_onnx.py" sub/esc.onnx escape > /dev/null || die "python escape"
  if "$kpl" import onnx sub/esc.onnx -o esc.kpl 2> err.txt; then die "data outside the directory was read"; fi
  grep -q "inside the model's directory" err.txt || die "escape: $(cat err.txt)"
  # a symbolic link beside the model to data outside its directory
  mkdir -p sub2 && /usr/bin/python3 "$here/torchvision_onnx.py" sub2/ln.onnx external > /dev/null \
    || die "python external (link)"
  mv sub2/ln.onnx.data outside.data && ln -s "$tmp/outside.data" sub2/ln.onnx.data
  if "$kpl" import onnx sub2/ln.onnx -o ln.kpl 2> err.txt; then die "data through a link was read"; fi
  grep -q "outside the model's directory .* (through a symbolic link)" err.txt || die "link: $(cat err.txt)"
  [[ ! -e ln.kpl ]] || die "a refused import left ln.kpl"
  # a NaN (refused, even with --check), batch norm folded by torch's eval-mode export
  /usr/bin/python3 "$here/torchvision_onnx.py" nan.onnx nan > /dev/null || die "python nan"
  if "$kpl" import onnx nan.onnx -o nan.kpl --check resnet18 --classes 1000 > /dev/null 2> err.txt; then
    die "a NaN was imported"
  fi
  grep -q "initializer 'layer3.1.bn2.running_var' holds NaN or inf (element 5 of 256)" err.txt \
    || die "NaN: $(cat err.txt)"
  [[ ! -e nan.kpl ]] || die "a refused import left nan.kpl"
  /usr/bin/python3 "$here/torchvision_onnx.py" folded.onnx folded > /dev/null || die "python folded"
  if "$kpl" import onnx folded.onnx -o folded.kpl --check resnet18 2> err.txt; then
    die "a folded export was imported"
  fi
  grep -q "initializers are named onnx::Conv_\*: the exporter folded batch norm" err.txt \
    && grep -q "training=torch.onnx.TrainingMode.TRAINING" err.txt || die "folded: $(cat err.txt)"
  # the weights start a run (the ImageNet stem's conv1 and the 1000-class fc left out)
  "$kpl" import onnx r18_plain.onnx -o w.kpl --exclude 'conv1.*' --exclude 'fc.*' > /dev/null 2>&1 \
    || die "import with exclusions"
  R18=("$src/recipes/fashion_mnist/resnet18.yaml" "${FM[@]}" deterministic=true model.width=64
       data.train.batch_size=8 max_steps=1 data.val.limit=16 log.every_steps=1)
  "$kpl" train "${R18[@]}" run_dir=run_w model.weights=w.kpl > tw.txt 2> tw.err || die "train with weights: $(tail -3 tw.err)"
  grep -rq "model.weights: 99 tensors from w.kpl" tw.txt tw.err run_w/ 2> /dev/null \
    || die "the run does not log its weights: $(grep -h weights tw.txt tw.err | head -3)"
  "$kpl" train "${R18[@]}" run_dir=run_0 > t0.txt 2> t0.err || die "train without weights"
  l1=$(sed -n 's/^epoch 1.* step 1\/.* loss \([0-9.]*\) .*/\1/p' tw.txt)
  l0=$(sed -n 's/^epoch 1.* step 1\/.* loss \([0-9.]*\) .*/\1/p' t0.txt)
  [[ -n "$l1" && "$l1" != "$l0" ]] || die "the first loss ($l1) is the one without weights ($l0)"
  if "$kpl" train "${R18[@]}" run_dir=run_x model.weights=w.kpl model.weights_into=nothing > /dev/null 2> tx.err; then
    die "model.weights_into of a missing module was accepted"
  fi
  grep -q "no module 'nothing'" tx.err || die "weights_into: $(tail -2 tx.err)"
  ;;
torch)
  # torchvision's ResNet-18 and -50 (random weights and batch-norm
  # statistics) as PyTorch users have them: kpl import torch of the state
  # dict and of a training script's checkpoint, kpl import onnx of a
  # training-mode export; the eval-mode export refused.  Through kpl export
  # and kpl infer, the logits of 2 images equal torch's (to 1e-4 from the
  # .pth, to 1e-5 from the ONNX file); then a recipe fine-tunes from them.
  [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c "import torch, torchvision, onnx" 2> /dev/null \
    || kpl_skip ref "python3-torch, python3-torchvision and onnx for /usr/bin/python3"
  "$gen" folder 4 6 3 > /dev/null || die "gen_imagefolder"
  # logits NAME WEIGHTS DEPTH TOL: exported at batch 2, run on x.npy
  logits() {
    "$kpl" export "$src/recipes/imagenet/resnet50.yaml" "${QUIET[@]}" model.depth=$3 \
      data.root="$tmp/in" data.convert.source="$tmp/folder" --checkpoint "$2" -o $1.kplm --batch 2 \
      > exp.txt 2> exp.err || die "$1: export: $(tail -3 exp.err)"
    "$kpl" infer $1.kplm m/x.npy --logits --top 1 > inf.txt 2> inf.err || die "$1: infer: $(cat inf.err)"
    sed -n 's/.*"logits":\[\([^]]*\)\].*/\1/p' inf.txt | tr ',' '\n' > $1.txt
    /usr/bin/python3 "$here/torch_ref.py" compare $1.txt m/logits.txt $4 > cmp.txt \
      || die "$1: $(cat cmp.txt)"
    echo "$1: $(cat cmp.txt)"
  }
  for arch in resnet18 resnet50; do
    depth=${arch#resnet}
    rm -rf m && mkdir m
    /usr/bin/python3 "$here/torch_ref.py" model m $arch > ref.log 2>&1 || die "torch_ref: $(tail -3 ref.log)"
    for f in $arch ${arch}_wrapped; do
      "$kpl" import torch m/$f.pth -o $f.kpl --check $arch --classes 1000 > imp.txt 2> imp.err \
        || die "import torch $f: $(cat imp.err)"
      grep -q '"missing":0,"unexpected":0}' imp.txt || die "import torch $f: $(cat imp.txt imp.err)"
    done
    "$kpl" import onnx m/${arch}_train.onnx -o ${arch}_onnx.kpl --check $arch --classes 1000 \
      > imp.txt 2> imp.err || die "import onnx (training mode): $(cat imp.err)"
    grep -q '"missing":0,"unexpected":0}' imp.txt || die "import onnx: $(cat imp.txt imp.err)"
    if "$kpl" import onnx m/${arch}_eval.onnx -o ev.kpl > /dev/null 2> imp.err; then
      die "the eval-mode (folded) export was imported"
    fi
    grep -q "the exporter folded batch norm" imp.err || die "folded: $(cat imp.err)"
    logits ${arch}_pth $arch.kpl $depth 1e-4
    logits ${arch}_wrapped ${arch}_wrapped.kpl $depth 1e-4
    logits ${arch}_onnx ${arch}_onnx.kpl $depth 1e-5
  done
  # fine-tuning from a .pth: model.weights (a new head for the 4 classes)
  "$kpl" import torch m/resnet50.pth -o ft.kpl --exclude 'fc.*' > /dev/null 2>&1 || die "import --exclude"
  "$kpl" train "$src/recipes/imagenet/resnet50.yaml" "${QUIET[@]}" data.root="$tmp/in" \
    data.convert.source="$tmp/folder" model.weights=ft.kpl model.num_classes=4 max_steps=1 \
    data.train.batch_size=2 data.val.limit=2 run_dir=ft > ft.txt 2> ft.err || die "fine-tune: $(tail -3 ft.err)"
  grep -rq "model.weights: 265 tensors from ft.kpl" ft.txt ft.err || die "fine-tune: $(grep -h weights ft.txt ft.err)"
  ;;
errors)
  recipe=$src/recipes/fashion_mnist/lenet.yaml
  train_short "$recipe" 3 64
  ck=run/checkpoints/ckpt-0000000003.kpl
  "$kpl" export "$recipe" "${FM[@]}" --checkpoint $ck -o m.kplm > /dev/null 2>&1 || die "export"
  size=$(stat -c %s m.kplm)
  head -c $((size - 100)) m.kplm > trunc.kplm
  cp m.kplm flip.kplm
  printf '\x55' | dd of=flip.kplm bs=1 seek=$((size / 2)) conv=notrunc 2> /dev/null
  for f in trunc flip; do
    set +e
    "$kpl" infer $f.kplm fm/test --limit 4 > o.txt 2> e.txt
    rc=$?
    set -e
    [[ $rc == 1 ]] || die "$f.kplm: exit $rc"
    grep -q "$f.kplm: .*\(truncated\|checksum\|damaged\|corrupt\)" e.txt || die "$f.kplm: $(cat e.txt)"
    [[ ! -s o.txt ]] || die "$f.kplm printed results"
  done
  set +e
  "$kpl" infer $ck fm/test > o.txt 2> e.txt
  rc=$?
  set -e
  [[ $rc == 1 ]] && grep -q "not a model file" e.txt || die "a checkpoint as a model: $rc $(cat e.txt)"
  # .npy inputs (the model takes (1, 28, 28)): the header's shape read
  # strictly, the data's size checked, NaN outputs printed as null, exit 1
  # npy FILE SHAPE FLOATS [WORD]: a version 1.0 .npy of FLOATS float32s
  # (the 4 bytes WORD as octal escapes, default 0.0) after the header
  npy() {
    local h="{'descr': '<f4', 'fortran_order': False, 'shape': $2, }"
    while (( (10 + ${#h} + 1) % 64 )); do h+=" "; done
    h+=$'\n'
    { printf '\223NUMPY\001\000'; printf "\\$(printf %03o $((${#h} % 256)))\\$(printf %03o $((${#h} / 256)))"
      printf '%s' "$h"; for ((k = 0; k < $3; k++)); do printf "${4:-\\0\\0\\0\\0}"; done; } > "$1"
  }
  npy ok.npy "(2, 1, 28, 28)" 1568
  "$kpl" infer m.kplm ok.npy > o.txt 2> e.txt || die "a good .npy: $(cat e.txt)"
  [[ $(grep -c '"input":"ok.npy#' o.txt) == 2 ]] || die "a good .npy: $(cat o.txt)"
  npy neg.npy "(-1, 1, 28, 28)" 784
  npy neg2.npy "(-2, 1, 28, 28)" 1568
  npy str.npy "('a', 1, 28, 28)" 784
  npy float.npy "(1.5, 1, 28, 28)" 784
  npy long.npy "(1, 1, 28, 28)" 785
  npy short.npy "(2, 1, 28, 28)" 1567
  for f in neg neg2 str float long short; do
    set +e
    "$kpl" infer m.kplm $f.npy > o.txt 2> e.txt
    rc=$?
    set -e
    [[ $rc == 1 ]] || die "$f.npy: exit $rc ($(cat o.txt))"
    grep -q "skipped $f.npy: .*\(shape is not a tuple\|bytes of data after the header\)" e.txt \
      || die "$f.npy: $(cat e.txt)"
    ! grep -q '"input"' o.txt || die "$f.npy printed rows: $(cat o.txt)"
  done
  npy nan.npy "(1, 1, 28, 28)" 784 '\0\0\300\177'
  set +e
  "$kpl" infer m.kplm nan.npy --logits > o.txt 2> e.txt
  rc=$?
  set -e
  [[ $rc == 1 ]] || die "NaN inputs: exit $rc"
  grep -q "nan.npy#0: the output holds NaN or inf" e.txt || die "NaN inputs: $(cat e.txt)"
  ! grep -qi 'nan[,}\]]' o.txt && grep -q '"prob":null' o.txt && grep -q '"logits":\[null' o.txt \
    && grep -q '"nonfinite":1' o.txt || die "NaN outputs as JSON: $(cat o.txt)"
  if [[ -x /usr/bin/python3 ]]; then
    /usr/bin/python3 -c 'import json, sys; [json.loads(l) for l in open(sys.argv[1])]' o.txt \
      || die "not JSON: $(cat o.txt)"
  fi
  expect_usage_error "export without -o" "-o MODEL.kplm are" export "$recipe" --checkpoint $ck
  expect_usage_error "infer without inputs" "at least one INPUT" infer m.kplm
  expect_usage_error "a bad level" "0, 1, 2 or 3" infer m.kplm x.png --level 7
  expect_usage_error "a GAN" "has no inference graph" export \
    "$src/recipes/gan/dcgan_fmnist.yaml" "${FM[@]}" --checkpoint $ck -o g.kplm
  [[ ! -e g.kplm && ! -e g.kplm.tmp ]] || die "a failed export left a file"
  ;;
*)
  die "unknown case"
  ;;
esac
echo "PASS ($case_)"
