#!/usr/bin/env python3
"""skipped.py JUNIT.xml SKIP_LOG — what scripts/test.sh prints at its end:
every test ctest skipped (exit 77) with the reason its output gave, and
every part of a passing test that was skipped (the lines tests/skip.sh,
kpl_test.h's KPL_SKIP and ref_missing.py append to SKIP_LOG).  A skip for
a missing reference tool ("ref") is a failure: exit 1.  Only the standard
library: this runs on a machine that has just been set up."""
import sys
import xml.etree.ElementTree as ET


def reason(out):
    """The lines of a skipped test's output that say why."""
    lines = [l.strip() for l in (out or "").splitlines() if l.strip()]
    why = [l for l in lines if "skip" in l.lower()]
    return "; ".join(why[-2:]) if why else (lines[-1] if lines else "no reason printed")


def main(junit, log):
    rows = []
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"skipped.py: cannot read {junit}: {e}", file=sys.stderr)
        return 1
    for case in root.iter("testcase"):
        if case.get("status") == "notrun" and case.find("skipped") is not None:
            out = case.findtext("system-out")
            kind = "ref" if "skipped (ref)" in (out or "") else "env"
            rows.append((case.get("name"), kind, reason(out)))
    try:
        with open(log) as f:
            for line in f:
                who, _, rest = line.rstrip("\n").partition(": ")
                kind, _, why = rest.partition(": ")
                rows.append((f"{who} (part)", kind, why))
    except OSError:
        pass
    if not rows:
        print("\nskipped: nothing")
        return 0
    print(f"\nskipped: {len(rows)}")
    for name, kind, why in rows:
        label = "a reference is missing" if kind == "ref" else "not on this machine"
        print(f"  {name}: {label}: {why}")
    refs = sum(kind == "ref" for _, kind, _ in rows)
    if refs:
        print(f"{refs} reference check(s) skipped: scripts/setup.sh installs what they need",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: skipped.py JUNIT.xml SKIP_LOG")
    sys.exit(main(sys.argv[1], sys.argv[2]))
