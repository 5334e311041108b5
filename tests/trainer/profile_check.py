#!/usr/bin/python3
"""profile_check.py — what profile_e2e.sh asserts of a run's step profile
and timing records (docs/profiling.md), with nothing but the standard
library.

  profile_check.py trace RUN_DIR RANKS FIRST LAST GRAD_BYTES ELEMENTS
      every rank's RUN_DIR/profile/rank-NNNNN.trace.json: the line in its
      log that kplrun looks for, the fixed layout, JSON, events of steps
      FIRST..LAST only, each step's spans nested in it, the backward's
      module spans covering the model (ELEMENTS: its modules' parameter
      element counts, comma-separated), the buckets' bytes summing to
      GRAD_BYTES per step (RANKS > 1), the ranks' clocks lining up
  profile_check.py timing RUN_DIR RANKS GRAD_BYTES STEPS [SLOWEST MIN_GAP_MS]
      metrics.jsonl's timing records: at STEPS (comma-separated), with the
      train records, parts adding up to step_ms, step_ms agreeing with the
      records' own wall times, the bucketer's bytes, a slowest rank (with
      SLOWEST: that one in every record after the first, and the median of
      those records at least MIN_GAP_MS per step slower than the fastest;
      the first window holds the first step's one-time work, oneDNN's
      code generation and the kernel chooser's timing, which a loaded
      machine makes hundreds of ms longer on either rank)
  profile_check.py memory RUN_DIR STEP PARAMS
      RUN_DIR/profile/memory-rank-00000.json (profile.memory) of the
      window [STEP, STEP]: the log line, the blocks adding up to the peak
      exactly and the peak to the timing record of that step within 2%,
      the reasons' totals, every parameter (PARAMS: name:elements,
      comma-separated) a block of its own size as parameter and its
      momentum as optimizer state, the graph's holders naming an op and a
      module, every block a creator; the trace's allocated-bytes counter
      reaching the peak
Exits 1 with the first failure."""
import json
import os
import re
import sys

LOG_LINE = re.compile(r"profile: steps ([0-9]+)-([0-9]+) written to (/[^ ]+)$")
HEAD = '{"displayTimeUnit":"ms","traceEvents":['
TOL_US = 2.0  # the wall-clock microseconds of ~1.7e15 lose quarter microseconds in a float


def fail(msg):
    print("profile_check: " + msg, file=sys.stderr)
    sys.exit(1)


def within(inner, outer, what):
    a, b = inner["ts"], inner["ts"] + inner["dur"]
    c, d = outer["ts"], outer["ts"] + outer["dur"]
    if a < c - TOL_US or b > d + TOL_US:
        fail("%s: [%.3f, %.3f] is not within %s [%.3f, %.3f]" % (what, a, b, outer["name"], c, d))


def read_trace(run, rank, first, last):
    log = os.path.join(run, "logs", "rank-%05d.log" % rank)
    found = [m for m in (LOG_LINE.search(l.rstrip("\n")) for l in open(log)) if m]
    if len(found) != 1:
        fail("rank %d: %d 'profile: ... written to' lines in %s, expected 1" % (rank, len(found), log))
    m = found[0]
    path = os.path.realpath(os.path.join(run, "profile", "rank-%05d.trace.json" % rank))
    if (int(m.group(1)), int(m.group(2))) != (first, last) or m.group(3) != path:
        fail("rank %d: the log says '%s', expected steps %d-%d written to %s"
             % (rank, m.group(0), first, last, path))
    text = open(path).read()
    if not text.endswith("]}\n"):
        fail("%s does not end with ']}' and a newline" % path)
    lines = text[:-1].split("\n")
    if lines[0] != HEAD or lines[-1] != "]}" or len(lines) < 3:
        fail("%s: first line %r, last %r" % (path, lines[0], lines[-1]))
    body = lines[1:-1]
    events = []
    for i, l in enumerate(body):
        last_line = i == len(body) - 1
        if l.endswith(",") == last_line:
            fail("%s line %d: %s a comma: %r" % (path, i + 2, "ends with" if last_line else "lacks", l))
        try:
            events.append(json.loads(l[:-1] if not last_line else l))
        except ValueError as e:
            fail("%s line %d is not one JSON object (%s): %r" % (path, i + 2, e, l))
    whole = json.loads(text)
    if whole.get("displayTimeUnit") != "ms" or whole["traceEvents"] != events:
        fail("%s: the document differs from its lines" % path)
    return events


def check_rank(events, rank, first, last, ranks, grad_bytes, elements):
    meta = [e for e in events if e["ph"] == "M"]
    names = {(e["name"], e["tid"]): e["args"] for e in meta}
    pname = names.get(("process_name", 0), {}).get("name", "")
    if not pname.startswith("rank %d (" % rank):
        fail("rank %d: process name %r" % (rank, pname))
    lanes = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    if lanes != {0: "step", 1: "backward by module", 2: "allreduce"}:
        fail("rank %d: lanes %r" % (rank, lanes))
    timed = [e for e in events if e["ph"] != "M"]
    for e in timed:
        if e["pid"] != rank or e["ph"] not in ("X", "i"):
            fail("rank %d: event %r" % (rank, e))
        if not first <= e["args"]["step"] <= last:
            fail("rank %d: an event of step %d outside %d..%d: %r" % (rank, e["args"]["step"], first, last, e))
        if e["ph"] == "X" and e["dur"] < 0:
            fail("rank %d: negative duration: %r" % (rank, e))
    steps = {}
    for s in range(first, last + 1):
        ev = [e for e in timed if e["args"]["step"] == s]
        one = {}
        for n in ("step %d" % s, "forward", "backward", "optimizer"):
            got = [e for e in ev if e["name"] == n and e["tid"] == 0]
            if len(got) != 1:
                fail("rank %d step %d: %d '%s' spans, expected 1" % (rank, s, len(got), n))
            one[n] = got[0]
        st = one["step %d" % s]
        for n in ("forward", "backward", "optimizer"):
            within(one[n], st, "rank %d step %d %s" % (rank, s, n))
        for e in ev:
            if e["tid"] == 0 and e["name"] in ("data wait", "allreduce wait"):
                within(e, st, "rank %d step %d %s" % (rank, s, e["name"]))
        if not [e for e in ev if e["name"] == "data wait"]:
            fail("rank %d step %d: no data wait" % (rank, s))
        f, b, o = one["forward"], one["backward"], one["optimizer"]
        if f["ts"] + f["dur"] > b["ts"] + TOL_US or b["ts"] + b["dur"] > o["ts"] + TOL_US:
            fail("rank %d step %d: forward, backward, optimizer overlap" % (rank, s))
        # the backward by module: one span per module, end to end, inside
        # the backward, together the model's parameters
        mods = sorted((e for e in ev if e["tid"] == 1), key=lambda e: e["ts"])
        if sorted(e["args"]["elements"] for e in mods) != sorted(elements):
            fail("rank %d step %d: module spans of %r elements, expected %r"
                 % (rank, s, [e["args"]["elements"] for e in mods], elements))
        if abs(mods[0]["ts"] - b["ts"]) > TOL_US:
            fail("rank %d step %d: the first module span starts at %.3f, the backward at %.3f"
                 % (rank, s, mods[0]["ts"], b["ts"]))
        for x, y in zip(mods, mods[1:]):
            if abs(x["ts"] + x["dur"] - y["ts"]) > TOL_US:
                fail("rank %d step %d: module spans %s and %s are not end to end" % (rank, s, x["name"], y["name"]))
        for e in mods:
            within(e, b, "rank %d step %d module %s" % (rank, s, e["name"]))
        lane2 = [e for e in ev if e["tid"] == 2]
        buckets = [e for e in lane2 if e["ph"] == "X"]
        if ranks == 1:
            if lane2:
                fail("rank %d step %d: allreduce events in a single-process run" % (rank, s))
        else:
            total = sum(e["args"]["bytes"] for e in buckets)
            if total != grad_bytes:
                fail("rank %d step %d: the buckets moved %d bytes, the gradients are %d" % (rank, s, total, grad_bytes))
            issues = {e["args"]["bucket"]: e for e in lane2 if e["ph"] == "i"}
            for e in buckets:
                i = issues.get(e["args"]["bucket"])
                if i is None or i["ts"] > e["ts"] + TOL_US or e["args"]["ready_to_start_ms"] < -1e-3:
                    fail("rank %d step %d: bucket %r issued %r" % (rank, s, e, i))
            if len([e for e in ev if e["name"] == "allreduce wait"]) != 1:
                fail("rank %d step %d: no allreduce wait span" % (rank, s))
        steps[s] = (st, buckets)
    return steps


def trace(run, ranks, first, last, grad_bytes, elements):
    per_rank = []
    for r in range(ranks):
        events = read_trace(run, r, first, last)
        per_rank.append(check_rank(events, r, first, last, ranks, grad_bytes, elements))
    # one clock: a step's bucket allreduce on one rank overlaps the same
    # bucket's on every other (neither ends before both have begun)
    for s in range(first, last + 1):
        for r in range(1, ranks):
            for a, b in zip(per_rank[0][s][1], per_rank[r][s][1]):
                if a["ts"] > b["ts"] + b["dur"] + 1000 or b["ts"] > a["ts"] + a["dur"] + 1000:
                    fail("step %d: rank 0's %s [%.0f +%.0f us] and rank %d's [%.0f +%.0f us] do not overlap"
                         % (s, a["name"], a["ts"], a["dur"], r, b["ts"], b["dur"]))
    print("trace: %d ranks x steps %d-%d OK" % (ranks, first, last))


PARTS = ("data_wait_ms", "compute_ms", "comm_exposed_ms", "optimizer_ms", "other_ms")


def timing(run, ranks, grad_bytes, steps, slowest=None, min_gap=0.0):
    recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    tim = [r for r in recs if r["event"] == "timing"]
    train = [r["step"] for r in recs if r["event"] == "train"]
    got = [r["step"] for r in tim]
    if got != steps or train != steps:
        fail("timing records at steps %r, train records at %r, expected %r" % (got, train, steps))
    prev = None
    gaps = []
    for r in tim:
        parts = [r[k] for k in PARTS]
        if min(parts + [r["sync_ms"], r["comm_ms"], r["bucket_wait_ms"]]) < 0:
            fail("step %d: a negative part: %r" % (r["step"], r))
        if abs(sum(parts) - r["step_ms"]) > 1e-6 * r["step_ms"] + 1e-4:
            fail("step %d: the parts add up to %.6f ms, step_ms is %.6f" % (r["step"], sum(parts), r["step_ms"]))
        if r["sync_ms"] > r["other_ms"] + 1e-6:
            fail("step %d: sync_ms %.6f is more than other_ms" % (r["step"], r["sync_ms"]))
        if r["steps"] != r["step"] - (prev["step"] if prev else 0):
            fail("step %d: a window of %d steps" % (r["step"], r["steps"]))
        # step_ms against the records' own wall times (1 ms resolution),
        # within one epoch (the end of an epoch is not a step's time).  A
        # window starts at the previous report, before its record's time
        # is taken, so the two clocks differ by that report's work (ms of
        # JSON and an allgather, more on a loaded machine): 20 ms or 30%.
        if prev and (r["step"] - 1) // EPOCH == (prev["step"] - 1) // EPOCH and prev["step"] % EPOCH:
            wall = (r["time"] - prev["time"]) * 1e3
            if abs(wall - r["step_ms"] * r["steps"]) > max(20.0, 0.3 * wall):
                fail("step %d: %d steps of %.3f ms, but %.3f ms passed between the records"
                     % (r["step"], r["steps"], r["step_ms"], wall))
        if r["peak_mb"] <= 0 or r["peak_mb_max"] < r["peak_mb"]:
            fail("step %d: peak %r, max %r" % (r["step"], r["peak_mb"], r["peak_mb_max"]))
        if not 0 <= r["slowest_rank"] < ranks or r["slowest_step_ms"] < r["fastest_step_ms"]:
            fail("step %d: slowest rank %d (%.3f ms), fastest %.3f ms"
                 % (r["step"], r["slowest_rank"], r["slowest_step_ms"], r["fastest_step_ms"]))
        if ranks == 1:
            if r["comm_ms"] or r["buckets"] or r["bytes_per_step"] or r["comm_exposed_ms"]:
                fail("step %d: communication in a single-process run: %r" % (r["step"], r))
            if abs(r["slowest_step_ms"] - r["step_ms"]) > 1e-6 * r["step_ms"] + 1e-4:
                fail("step %d: one rank's own time %.6f is not its step %.6f" % (r["step"], r["slowest_step_ms"], r["step_ms"]))
        elif r["bytes_per_step"] != grad_bytes or r["buckets"] < 1:
            fail("step %d: %d bytes per step in %d buckets, the gradients are %d bytes"
                 % (r["step"], r["bytes_per_step"], r["buckets"], grad_bytes))
        if slowest is not None and prev is not None:
            gap = r["slowest_step_ms"] - r["fastest_step_ms"]
            if r["slowest_rank"] != slowest:
                fail("step %d: slowest rank %d, %.3f ms over the fastest; expected rank %d"
                     % (r["step"], r["slowest_rank"], gap, slowest))
            gaps.append(gap)
        prev = r
    if slowest is not None:
        if not gaps:
            fail("no timing record after the first to name the slowest rank")
        gaps.sort()
        median = gaps[len(gaps) // 2] if len(gaps) % 2 else (gaps[len(gaps) // 2 - 1] + gaps[len(gaps) // 2]) / 2
        if median < min_gap:
            fail("rank %d is the slowest by a median %.3f ms a step over the fastest (%s); expected at least %.1f"
                 % (slowest, median, ", ".join("%.1f" % g for g in gaps), min_gap))
    print("timing: %d records OK (steps %s)" % (len(tim), ",".join(map(str, got))))


MEM_LINE = re.compile(r"profile\.memory: steps ([0-9]+)-([0-9]+) peaked at ([0-9.]+) MB allocated "
                      r"\(([0-9]+) blocks\), written to (.+)$")


def memory(run, step, params):
    log = os.path.join(run, "logs", "rank-00000.log")
    found = [m for m in (MEM_LINE.search(l.rstrip("\n")) for l in open(log)) if m]
    if len(found) != 1:
        fail("%d 'profile.memory: ... written to' lines in %s, expected 1" % (len(found), log))
    m = found[0]
    prof = json.load(open(os.path.join(run, "profile", "memory-rank-00000.json")))
    blocks, peak = prof["blocks"], prof["peak_bytes"]
    if (int(m.group(1)), int(m.group(2))) != (step, step) or prof["steps"] != [step, step]:
        fail("steps: the log says %s-%s, the file %r; expected %d" % (m.group(1), m.group(2), prof["steps"], step))
    if int(m.group(4)) != len(blocks) or abs(float(m.group(3)) - peak / 1048576.0) > 0.051:
        fail("the log says %s MB in %s blocks, the file %d bytes in %d" % (m.group(3), m.group(4), peak, len(blocks)))
    total = sum(b["bytes"] for b in blocks)
    if total != peak:
        fail("the blocks add up to %d bytes, the peak is %d" % (total, peak))
    tim = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
           if r["event"] == "timing" and r["step"] == step and r["steps"] == 1]
    if len(tim) != 1:
        fail("no timing record of step %d alone (log.every_steps=1)" % step)
    alloc_peak = tim[0]["peak_mb"] * 1048576.0
    if abs(alloc_peak - peak) > 0.02 * alloc_peak:
        fail("the profile's peak %d bytes, the allocator's %.0f (timing record): more than 2%% apart"
             % (peak, alloc_peak))
    sums = {}
    for b in blocks:
        if not b["creator"] or b["bytes"] <= 0 or b["bytes"] % 512:
            fail("a block without a creator or of an odd size: %r" % b)
        s = sums.setdefault(b["reason"], [0, 0])
        s[0] += b["bytes"]
        s[1] += 1
    by = {e["reason"]: [e["bytes"], e["blocks"]] for e in prof["by_reason"]}
    if by != sums:
        fail("by_reason %r, the blocks say %r" % (by, sums))
    for name, n in (p.split(":") for p in params.split(",")):
        size = (int(n) * 4 + 511) // 512 * 512
        for reason, holder in (("parameter", name), ("optimizer state", "momentum_buffer of " + name)):
            got = [b for b in blocks if b["reason"] == reason and b.get("holder") == holder]
            if len(got) != 1 or got[0]["bytes"] != size:
                fail("%s %s: %r, expected one block of %d bytes" % (reason, holder, got, size))
    saved = [b for b in blocks if b["reason"] == "saved for backward"]
    holder = re.compile(r"^saved for backward by [a-z0-9_]+ @ ([A-Za-z0-9_.]+|\(no module\))$")
    for b in saved:
        if not holder.match(b.get("holder", "")):
            fail("a saved block's holder names no op and module: %r" % b)
    events = read_trace(run, 0, step, step)
    points = [e for e in events if e.get("ph") == "C"]
    if not points or any(e["name"] != "allocated MB" or set(e["args"]) != {"value"} for e in points):
        fail("the trace's counter track: %r" % points[:3])
    top = max(e["args"]["value"] for e in points)
    if abs(top - peak / 1048576.0) > 0.001:
        fail("the counter track peaks at %.3f MB, the profile at %.3f" % (top, peak / 1048576.0))
    print("memory: %d blocks, peak %d bytes (allocator %.0f), %s" % (len(blocks), peak, alloc_peak,
          ", ".join("%s %d" % (k, v[0]) for k, v in sorted(sums.items()))))


EPOCH = 1 << 62  # steps per epoch (timing's EPOCH=N argument); none by default

if __name__ == "__main__":
    a = sys.argv[1:]
    for x in list(a):
        if x.startswith("EPOCH="):
            EPOCH = int(x[6:])
            a.remove(x)
    if len(a) == 7 and a[0] == "trace":
        trace(a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), [int(x) for x in a[6].split(",")])
    elif len(a) == 4 and a[0] == "memory":
        memory(a[1], int(a[2]), a[3])
    elif len(a) in (5, 7) and a[0] == "timing":
        timing(a[1], int(a[2]), int(a[3]), [int(x) for x in a[4].split(",")],
               int(a[5]) if len(a) == 7 else None, float(a[6]) if len(a) == 7 else 0.0)
    else:
        fail("usage: see the head of this file")
