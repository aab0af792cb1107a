#!/usr/bin/env python3
"""Registers, spills and shared memory of the kernels CubeCL compiled on CUDA.

CubeCL 0.10 keeps the PTX of every kernel it compiles (when its compilation
cache is on, as `attention-bench` turns it on) in CBOR chunk files,
`<cache root>/**/ptx/chunk*.cbor`: a sequence of `{key, value: {entrypoint_name,
shared_mem_bytes, ptx}}` items, `ptx` being the NUL-terminated text as an array
of bytes. This script decodes them (a minimal CBOR reader: no extra Python
package is needed on the device machine) and runs `ptxas -v` (Triton ships one)
on each, printing one JSON line per kernel.

Usage: ptx_registers.py <dir to search> [--arch sm_90a] [--ptxas PATH] [--keep DIR]
(ptxas: the CUDA toolkit's under /usr/local/cuda, else Triton's.)
"""

import argparse
import glob
import json
import os
import re
import struct
import subprocess
import sys
import tempfile


class Cbor:
    """Just enough of RFC 8949 for serde/ciborium output."""

    def __init__(self, data):
        self.data = data
        self.pos = 0

    def _arg(self, info):
        if info < 24:
            return info
        size = {24: 1, 25: 2, 26: 4, 27: 8}[info]
        value = int.from_bytes(self.data[self.pos:self.pos + size], "big")
        self.pos += size
        return value

    def item(self):
        head = self.data[self.pos]
        self.pos += 1
        major, info = head >> 5, head & 31
        if major == 7:
            if info == 20:
                return False
            if info == 21:
                return True
            if info in (22, 23):
                return None
            if info == 26:
                value = struct.unpack(">f", self.data[self.pos:self.pos + 4])[0]
                self.pos += 4
                return value
            if info == 27:
                value = struct.unpack(">d", self.data[self.pos:self.pos + 8])[0]
                self.pos += 8
                return value
            raise ValueError(f"unsupported simple value {info} at byte {self.pos - 1}")
        if info == 31:
            raise ValueError(f"indefinite lengths are not supported (byte {self.pos - 1})")
        arg = self._arg(info)
        if major == 0:
            return arg
        if major == 1:
            return -1 - arg
        if major in (2, 3):
            raw = self.data[self.pos:self.pos + arg]
            self.pos += arg
            return raw if major == 2 else raw.decode("utf-8")
        if major == 4:
            return [self.item() for _ in range(arg)]
        if major == 5:
            return {self._key(): self.item() for _ in range(arg)}
        if major == 6:
            return self.item()  # tag: the value
        raise AssertionError(major)

    def _key(self):
        key = self.item()
        return key if isinstance(key, (str, int)) else json.dumps(key, default=str)


def entries(path):
    with open(path, "rb") as f:
        reader = Cbor(f.read())
    while reader.pos < len(reader.data):
        yield reader.item()


def find_ptxas(given):
    # The PTX of NVRTC 13 is version 9.0: Triton's bundled ptxas (12.8) is
    # too old for it, so a CUDA toolkit's comes first.
    if given:
        return given
    for candidate in ["/usr/local/cuda/bin/ptxas", *sorted(glob.glob("/usr/local/cuda-*/bin/ptxas"))[::-1]]:
        if os.access(candidate, os.X_OK):
            return candidate
    try:
        import triton  # noqa: F401

        root = os.path.dirname(triton.__file__)
        for candidate in glob.glob(os.path.join(root, "**", "ptxas"), recursive=True):
            if os.access(candidate, os.X_OK):
                return candidate
    except ImportError:
        pass
    sys.exit("ptx_registers.py: no ptxas found (pass --ptxas)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--ptxas")
    parser.add_argument("--keep", help="also write each PTX here")
    args = parser.parse_args()
    ptxas = find_ptxas(args.ptxas)
    chunks = glob.glob(os.path.join(args.root, "**", "ptx", "chunk*.cbor"), recursive=True)
    if not chunks:
        sys.exit(f"ptx_registers.py: no ptx/chunk*.cbor under {args.root}")
    for chunk in chunks:
        for n, entry in enumerate(entries(chunk)):
            value = entry["value"]
            ptx = value["ptx"]
            ptx = bytes(b & 0xFF for b in ptx) if isinstance(ptx, list) else ptx
            ptx = ptx.rstrip(b"\0").decode()
            name = value["entrypoint_name"]
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                with open(os.path.join(args.keep, f"{n:03}_{name[:80]}.ptx"), "w") as f:
                    f.write(ptx)
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx)
                f.flush()
                run = subprocess.run(
                    [ptxas, "-v", f"--gpu-name={args.arch}", f.name, "-o", os.devnull],
                    capture_output=True,
                    text=True,
                )
            log = run.stdout + run.stderr
            record = {"kernel": name, "shared_bytes_declared": value.get("shared_mem_bytes")}
            for field, pattern in [
                ("registers", r"Used (\d+) registers"),
                ("spill_stores", r"(\d+) bytes spill stores"),
                ("spill_loads", r"(\d+) bytes spill loads"),
                ("stack_frame", r"(\d+) bytes stack frame"),
                ("shared_bytes", r"(\d+) bytes smem"),
            ]:
                match = re.search(pattern, log)
                record[field] = int(match.group(1)) if match else None
            # The comptime parameters are in the PTX only as the loop shapes;
            # the kernel's load-time size is what tells the variants apart.
            record["ptx_lines"] = ptx.count("\n")
            if run.returncode != 0:
                record["ptxas_error"] = log.strip()[-500:]
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
