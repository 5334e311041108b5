# e2e_common.sh — what train_e2e.sh and faults_e2e.sh share; sourced after
# they set case_.  A scratch directory (removed on exit) becomes the working
# directory.  No python or jq: a fresh Debian 12 that ran only the test
# setup has neither, so JSON lines are read with sed and compared with awk.
# Fashion-MNIST's IDX files: Debian's package, or KPL_FMNIST_DIR (the GPU
# kit carries a subset to a machine without the package)
fm=${KPL_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
# background jobs a failing check leaves behind are killed too
trap 'jobs -p | xargs -r kill -KILL 2> /dev/null; rm -rf "$tmp"' EXIT
cd "$tmp"
die() { echo "FAIL ($case_): $*" >&2; exit 1; }
# field NAME LINE: a number or string field of a flat JSON object
field() { sed -n 's/.*"'"$1"'":\("[^"]*"\|[^,}]*\).*/\1/p' <<<"$2" | tr -d '"'; }
# the (step, loss) pairs of a run's metrics.jsonl
losses() { sed -n 's/^{"event":"train","step":\([0-9]*\),.*"loss":\([^,]*\),.*/\1 \2/p' "$1/metrics.jsonl"; }
. "$(dirname "${BASH_SOURCE[0]}")/../skip.sh"
need_fm() { [[ -r $fm/t10k-images-idx3-ubyte.gz ]] || kpl_skip ref "Fashion-MNIST ($fm)"; }
QUIET=(log.progress=never)
# expect_usage_error WHAT NEEDLE ARGS...: "$kpl" ARGS exits 2 (a bad recipe,
# argument or plugin) with NEEDLE on stderr
expect_usage_error() {
  local what=$1 needle=$2
  shift 2
  set +e
  timeout 120 "$kpl" "$@" > out.txt 2> err.txt
  local rc=$?
  set -e
  [[ $rc == 2 ]] || die "$what: exit $rc, expected 2 ($(cat err.txt))"
  grep -qF -- "$needle" err.txt || die "$what: '$(cat err.txt)' lacks '$needle'"
}
# close_losses A B: two runs' (step, loss) lists have the same steps and
# losses within a relative 1e-4 (of |loss|, at least 0.01: figures that
# cross 0) (what 2 ranks x N hold to against 1 x 2N);
# prints the steps that differ
close_losses() {
  [[ -s $1 && $(wc -l < "$1") == $(wc -l < "$2") ]] || { echo "steps: $(wc -l < "$1") vs $(wc -l < "$2")"; return 1; }
  paste "$1" "$2" | awk '{ d = $2 - $4; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; if (m < 0.01) m = 0.01
                         if ($1 != $3 || d > 1e-4 * m) { print "step " $1 ": " $2 " vs step " $3 ": " $4; bad = 1 } }
                         END { exit bad }'
}
# check_coco GT DETS LINE [IMAGES]: pycocotools' COCOeval of a detection
# run's results file agrees with the figures kpl reported (detect_check.py);
# a missing pycocotools is a skipped part (a failure where references are
# required)
coco_check_py=$(dirname "${BASH_SOURCE[0]}")/detect_check.py
check_coco() {
  [[ -x /usr/bin/python3 ]] || { kpl_skip_note ref "/usr/bin/python3 (the pycocotools check)"; return 0; }
  local rc=0
  /usr/bin/python3 "$coco_check_py" "$@" > check.txt 2>&1 || rc=$?
  cat check.txt
  [[ $rc == 77 ]] && kpl_skip_note ref "pycocotools for /usr/bin/python3" && return 0
  grep -q "reference missing" check.txt && die "$(cat check.txt)"
  [[ $rc == 0 ]] || die "pycocotools disagrees with kpl: $(cat check.txt)"
}
