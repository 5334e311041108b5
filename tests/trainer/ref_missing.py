"""ref_missing.py — a reference check's module cannot be imported: the
Python side of tests/skip.sh's "ref" kind.  With KPL_REQUIRE_REFS=1
(scripts/test.sh) or CI=true the check fails (exit 1); otherwise it is a
skip (exit 77); a caller running it as part of a test notes that
(tests/skip.sh's kpl_skip_note), ctest lists a skipped test."""
import os
import sys


def missing(script, what):
    """Exits: 1 when references are required, else 77 after noting it."""
    required = os.environ.get("KPL_REQUIRE_REFS") == "1" or os.environ.get("CI") == "true"
    if required:
        print(f"{script}: reference missing: {what} (scripts/setup.sh installs it)",
              file=sys.stderr)
        sys.exit(1)
    print(f"skipped (ref): {script}: {what}")
    sys.exit(77)
