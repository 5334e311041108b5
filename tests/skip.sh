# skip.sh — how a shell test says it cannot run (all or part of it) here.
# Sourced.  Two kinds of reasons:
#   env  the machine lacks a capability: a GPU, mpirun, namespaces, cores.
#        A skip, always.
#   ref  a reference tool or data set that scripts/setup.sh installs
#        (pycocotools, onnx/onnxruntime, numpy, scipy, Fashion-MNIST): an
#        equivalence check without its reference says nothing, so with
#        KPL_REQUIRE_REFS=1 (scripts/test.sh sets it) or CI=true it is a
#        failure, exit 1; otherwise a skip.
# A skipped part of a test (kpl_skip_note) is noted, with its test and
# reason, in $KPL_SKIP_LOG when set; scripts/test.sh prints that list and
# ctest's skipped tests (with the "skipped (...)" line they print) at its
# end.
kpl_refs_required() { [[ ${KPL_REQUIRE_REFS:-} == 1 || ${CI:-} == true ]]; }
kpl__skip() {
  local kind=$1 why=$2 who=${case_:-$(basename "$0")}
  if [[ $kind == ref ]] && kpl_refs_required; then
    echo "FAIL ($who): reference missing: $why (scripts/setup.sh installs it)" >&2
    exit 1
  fi
  echo "skipped ($kind): $why"
}
# kpl_skip_note KIND WHY: a part of the test is skipped (or exit 1 for a
# required reference)
kpl_skip_note() {
  kpl__skip "$1" "$2"
  [[ -z ${KPL_SKIP_LOG:-} ]] || echo "${case_:-$(basename "$0")}: $1: $2" >> "$KPL_SKIP_LOG"
}
# kpl_skip KIND WHY: the whole test cannot run (exit 77, ctest's skip)
kpl_skip() { kpl__skip "$1" "$2"; exit 77; }
