"""Summarises an Nsight Systems trace (exported to SQLite) of a few training steps: where
the host thread spends its time in CUDA driver calls and OS runtime calls, and how busy the
GPU is, over the last `--window-ms` of GPU activity (the tail of the trace: the last steps).

    nsys export --type sqlite -o step.sqlite step.nsys-rep
    python3 benches/nsys_summary.py step.sqlite [--window-ms 500]
"""
import argparse
import sqlite3


def table_exists(db, name):
    return db.execute("select 1 from sqlite_master where name=?", (name,)).fetchone() is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sqlite")
    ap.add_argument("--window-ms", type=float, default=400.0,
                    help="the last this many ms of GPU activity are summarised")
    args = ap.parse_args()
    db = sqlite3.connect(args.sqlite)
    names = dict(db.execute("select id, value from StringIds"))
    end = db.execute("select max(end) from CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    start = end - int(args.window_ms * 1e6)
    print(f"window: last {args.window_ms:.0f} ms of the trace")

    kernels = db.execute(
        "select start, end from CUPTI_ACTIVITY_KIND_KERNEL where start >= ? order by start",
        (start,)).fetchall()
    busy, last_end = 0, start
    for s, e in kernels:
        s = max(s, last_end)
        if e > s:
            busy += e - s
            last_end = e
    print(f"GPU: {len(kernels)} kernels, busy {busy / 1e6:.1f} ms of {args.window_ms:.0f} ms "
          f"({100 * busy / (end - start):.0f}%)")

    for table, label in [("CUPTI_ACTIVITY_KIND_RUNTIME", "CUDA API (driver + runtime)"),
                         ("OSRT_API", "OS runtime")]:
        if not table_exists(db, table):
            print(f"{label}: no table {table}")
            continue
        rows = db.execute(
            f"select nameId, count(*), sum(end - start) from {table} where start >= ? "
            "group by nameId order by 3 desc limit 15", (start,)).fetchall()
        print(f"\n{label}, top calls by total time in the window:")
        for name_id, n, total in rows:
            print(f"  {names.get(name_id, name_id)[:60]:60} {n:8d} calls {total / 1e6:9.2f} ms")


if __name__ == "__main__":
    main()
