"""Compare two ``hlo_dump.py`` outputs instruction by instruction, leaving out the stack-frame
tables and ids that newer jax versions write (they name source files and lines), and count each
side's instructions by opcode where they differ."""

import collections
import difflib
import re
import sys


def instructions(path):
    out, keep = [], False
    for line in open(path):
        if line.startswith(("HloModule", "%", "ENTRY")):
            keep = True
        if line.startswith(("FileNames", "FunctionNames", "FileLocations", "StackFrames")):
            keep = False
        if keep:
            out.append(re.sub(r", stack_frame_id=\d+", "", line))
    return out


def opcodes(lines):
    return collections.Counter(m[1] for line in lines if (m := re.search(r" = \S+ ([a-z-]+)\(", line)))


a, b = instructions(sys.argv[1]), instructions(sys.argv[2])
count = [sum(" = " in line for line in side) for side in (a, b)]
if not list(difflib.unified_diff(a, b, n=0)):
    print(f"{count[0]} vs {count[1]} instructions: identical")
else:
    ca, cb = opcodes(a), opcodes(b)
    print(f"{count[0]} vs {count[1]} instructions; opcodes that differ:",
          {op: (ca[op], cb[op]) for op in sorted(set(ca) | set(cb)) if ca[op] != cb[op]})
