#!/usr/bin/env python3
"""Summarise folded CPU stacks (`aam-dev step --cpu-profile FILE`).

Prints, per thread, the share of samples: (1) self time by crate (the leaf
frame's first path segment), (2) inclusive time by crate (a sample counts once
for every crate on its stack), (3) the hottest leaf functions, and (4) the
hottest frames inclusive, so that both "what burns the cycles" and "who asked
for it" show.

Usage: python3 benches/folded_summary.py FILE [--top N] [--thread NAME]
"""
import argparse
import collections
import re


def crate_of(symbol: str) -> str:
    s = symbol.lstrip("<&*")
    s = re.sub(r"^(dyn |mut |impl )", "", s)
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)::", s)
    if m:
        return m.group(1)
    if s.startswith("0x") or not s:
        return "?"
    return "[" + s.split("@")[0][:40] + "]"


def short(symbol: str, width: int = 150) -> str:
    s = re.sub(r"::h[0-9a-f]{16}$", "", symbol)
    return s if len(s) <= width else s[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", default=None)
    args = ap.parse_args()
    per_thread = collections.Counter()
    stacks = []
    for line in open(args.file):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        per_thread[thread] += int(count)
        stacks.append((thread, frames, int(count)))
    total = sum(per_thread.values())
    print(f"{total} samples")
    for thread, n in per_thread.most_common():
        print(f"  thread {thread}: {n} ({100 * n / total:.1f}%)")
    threads = [args.thread] if args.thread else [t for t, _ in per_thread.most_common(2)]
    for thread in threads:
        n = per_thread[thread]
        own = [(f, c) for t, f, c in stacks if t == thread]
        self_crate = collections.Counter()
        incl_crate = collections.Counter()
        self_fn = collections.Counter()
        incl_fn = collections.Counter()
        for frames, c in own:
            leaf = frames[-1] if frames else "?"
            self_crate[crate_of(leaf)] += c
            self_fn[short(leaf)] += c
            for crate in {crate_of(f) for f in frames}:
                incl_crate[crate] += c
            for f in {short(f) for f in frames}:
                incl_fn[f] += c
        print(f"\n== thread {thread}: {n} samples")
        for title, counter in [
            ("self by crate", self_crate),
            ("inclusive by crate", incl_crate),
            ("self by function", self_fn),
            ("inclusive by function", incl_fn),
        ]:
            print(f"-- {title}")
            for key, c in counter.most_common(args.top):
                print(f"  {100 * c / n:5.1f}%  {key}")


if __name__ == "__main__":
    main()
