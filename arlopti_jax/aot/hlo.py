"""Reading a compiled program's optimized HLO text (``compiled.as_text()``) and XLA:GPU's thunk
sequence: collectives, memory traffic and kernel launches, where a compiler reports no cost.

XLA:TPU's ``cost_analysis()`` gives flops and bytes; XLA:GPU's compile-only executables give
nothing, so bytes are counted here the way XLA's own cost analysis does: every kernel (a fusion,
a library call, a copy) reads its operands and writes its result once, except that a fusion
parameter read only through slices costs the slices, and a dynamic-update-slice in place costs
its update, not the whole buffer. A while loop with a known trip count (the layer loop) counts
its body that many times; the decode loop's trip count is unknown, and its body is what
``loop_body_bytes`` reports: one decode step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from pathlib import Path

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1,
               "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "domain", "iota"}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string: an array ``bf16[28,512]{1,0}`` or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the raw text between the parentheses (a parameter's number)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    def attr_set(self, key: str) -> str:
        """The text of a ``key={...}`` attribute ('' if absent): a dot's contracting dimensions."""
        m = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.attrs)
        return m.group(1) if m else ""


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _instruction(line: str) -> Instruction | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if " = " not in line or not line.startswith("%"):
        return None
    name, rest = line.split(" = ", 1)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    end = _balanced(rest, m.end() - 1)
    args = rest[m.end():end - 1]
    return Instruction(name.lstrip("%"), shape, m.group(1), re.findall(r"%([\w.\-]+)", args), rest[end:], args)


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation: instructions}, the entry computation's name) of an HLO module's text."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            inst = _instruction(line)
            if inst is not None:
                comps[current].append(inst)
    return comps, entry


def trip_count(inst: Instruction, comps: dict[str, list[Instruction]] | None = None) -> int | None:
    """A while loop's trip count: XLA:GPU's ``known_trip_count``, else (XLA:TPU does not print it)
    a condition ``i < N`` against a constant, the induction variable starting at 0 in the
    loop's initial tuple (a layer scan's form)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
    if m:
        return int(m.group(1))
    cond = (comps or {}).get(inst.attr("condition") or "", [])
    if not cond or cond[-1].opcode != "compare" or "direction=LT" not in cond[-1].attrs:
        return None
    values = {i.name: i for i in cond}
    lhs, rhs = (values.get(o) for o in cond[-1].operands[:2])
    if lhs is None or rhs is None or rhs.opcode != "constant" or lhs.opcode != "get-tuple-element":
        return None
    bound = re.match(r"\s*(-?\d+)", rhs.args)
    return int(bound.group(1)) if bound and int(bound.group(1)) > 0 else None


UNCOSTED_TPU_CALLS = ("ConcatBitcast",)  # custom calls XLA:TPU's estimate counts as -1 s each


def tpu_estimate(optimal_seconds: float | None, text: str) -> float | None:
    """XLA:TPU's time estimate (``cost_analysis()["optimal_seconds"]``) of a loop-free program
    whose optimized HLO is ``text``, or None where it is unusable. libtpu 0.0.42.1 adds -1 s per
    ``ConcatBitcast`` custom call it emits (a concatenation done as a bitcast: no data moves):
    the estimate of one decode step at 1.5B with 1, 2, 3, 4, 8 and 28 layers read 2.1, -3998.1,
    -2997.8, 2.6, -2996.4 and -990.3 ms with 0, 4, 3, 0, 3 and 1 of them. Those seconds are
    added back (the calls costed at zero); what stays negative is unusable."""
    if optimal_seconds is None:
        return None
    calls = sum(len(re.findall(rf'custom_call_target="{name}"', text)) for name in UNCOSTED_TPU_CALLS)
    seconds = float(optimal_seconds) + calls
    return seconds if seconds > 0 else None


def tpu_cycles_by_op(text: str, depth: int = 3) -> dict[str, int]:
    """XLA:TPU's per-kernel cost model, summed by source operation: the ``estimated_cycles`` each
    kernel of a loop-free program carries in its backend config, keyed by the first ``depth``
    parts of its ``op_name`` metadata after the ``jit(...)`` prefix (for example
    ``Block/attn/bkgth,bksh->bkgts``, or ``transpose(jvp(Block))/mlp/...`` in a backward pass),
    largest first. Shares of this sum say where the compiler's estimate goes."""
    out: dict[str, int] = {}
    for line in text.split("\n"):
        cycles = re.search(r'"estimated_cycles":"?(\d+)', line)
        if not cycles:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        name = re.sub(r"^jit\([^)]*\)/", "", op.group(1)) if op else "(no op_name)"
        key = "/".join(name.split("/")[:depth])
        out[key] = out.get(key, 0) + int(cycles.group(1))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class Module:
    """An optimized HLO module: traffic, collectives and loops, per execution of a computation."""

    def __init__(self, text: str):
        self.comps, self.entry = parse(text)
        self.by_name = {c: {i.name: i for i in insts} for c, insts in self.comps.items()}

    def _fusion_bytes(self, inst: Instruction, comp: str) -> float:
        """A fusion's reads and writes: a parameter read only through slices costs the slices;
        the buffer of an in-place dynamic-update-slice costs the update written."""
        called = inst.attr("calls")
        body = self.comps.get(called or "", [])
        users: dict[str, list[Instruction]] = {}
        for i in body:
            for op in i.operands:
                users.setdefault(op, []).append(i)

        def reads(name: str) -> list[tuple[Instruction, str]]:  # (user, the name it reads) through bitcasts
            out = []
            for u in users.get(name, []):
                out += reads(u.name) if u.opcode == "bitcast" else [(u, name)]
            return out
        outer = self.by_name[comp]
        total = 0.0
        for position, operand in enumerate(inst.operands):
            whole = shape_bytes(outer[operand].shape) if operand in outer else 0.0
            param = next((p.name for p in body if p.opcode == "parameter" and _param_number(p) == position), None)
            uses = reads(param) if param else []
            if uses and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == v for u, v in uses):
                total += sum(shape_bytes(u.shape) for u, _ in uses)
            elif uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == v for u, v in uses):
                total += 0.0  # updated in place: the written slice is counted with the output
            else:
                total += whole
        root = body[-1] if body else None
        roots = ([self.by_name[called][o] for o in root.operands] if root is not None and root.opcode == "tuple"
                 else [root])
        for r in roots:
            if r is None:
                continue
            if r.opcode == "dynamic-update-slice":
                total += shape_bytes(self.by_name[called][r.operands[1]].shape)
            else:
                total += shape_bytes(r.shape)
        return total

    def bytes(self, comp: str | None = None, loops_known_only: bool = False) -> float:
        """Memory traffic of one execution of ``comp`` (default: the entry). While loops with a
        known trip count count their body that many times; others once."""
        comp = comp or self.entry
        total = 0.0
        for inst in self.comps[comp]:
            op = inst.opcode
            if op in FREE or op.endswith("-done"):
                continue
            if op == "while":
                total += self.bytes(inst.attr("body")) * (trip_count(inst, self.comps) or 1)
            elif op in ("call", "conditional"):
                called = inst.attr("to_apply") or inst.attr("true_computation")
                total += self.bytes(called) if called in self.comps else 0.0
            elif op == "fusion":
                total += self._fusion_bytes(inst, comp)
            elif op.startswith(COLLECTIVES):
                continue  # network traffic: ``collectives``
            elif op == "dynamic-update-slice":  # in place: the update read and written
                total += 2 * shape_bytes(self.by_name[comp][inst.operands[1]].shape)
            else:
                outer = self.by_name[comp]
                total += shape_bytes(inst.shape) + sum(shape_bytes(outer[o].shape) for o in inst.operands if o in outer)
                if op == "custom-call":  # an output aliased to an operand (a kernel updating a buffer in place)
                    found = re.search(r"output_to_operand_aliasing=\{(.*?\))\}", inst.attrs)
                    aliased = re.findall(r"\{[\d,]*\}: \((\d+),", found.group(1)) if found else []
                    total -= sum(shape_bytes(outer[inst.operands[int(i)]].shape) for i in aliased
                                 if inst.operands[int(i)] in outer)
        return total

    def flops(self, comp: str | None = None) -> float:
        """Matrix FLOPs of one execution of ``comp`` (default: the entry), where a compiler reports
        none (XLA:GPU compile-only): every ``dot`` (inside fusions too) at 2 x its output's elements
        x its contracted size, and cuDNN's fused attention at 4 B N T S H forward and 10 B N T S H
        backward (two and five [T, S] x H products; with a bias or mask operand it computes every
        pair). Elementwise work is not counted. While loops with a known trip count count their
        body that many times; others once."""
        comp = comp or self.entry
        total = 0.0
        for inst in self.comps[comp]:
            found = re.search(r'custom_call_target="([^"]*)"', inst.attrs) if inst.opcode == "custom-call" else None
            target = found.group(1) if found else ""
            if inst.opcode == "while":
                total += self.flops(inst.attr("body")) * (trip_count(inst, self.comps) or 1)
            elif inst.opcode in ("call", "conditional", "fusion"):
                called = inst.attr("calls") or inst.attr("to_apply") or inst.attr("true_computation")
                total += self.flops(called) if called in self.comps else 0.0
            elif inst.opcode == "dot" or "$gemm" in target or "$matmul" in target:
                lhs = self.by_name[comp].get(inst.operands[0]) if inst.operands else None
                found = _ARRAY.search(lhs.shape) if lhs else None
                if not found:
                    continue
                dims = [int(d) for d in found.group(2).split(",") if d]
                if inst.opcode == "dot":
                    axes = inst.attr_set("lhs_contracting_dims")
                else:  # cuBLAS: the dimension numbers are in the backend config
                    m = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', inst.attrs)
                    axes = m.group(1) if m else ""
                contracted = math.prod(dims[int(i)] for i in re.findall(r"\d+", axes))
                total += 2 * _elements(inst.shape) * contracted
            elif inst.opcode == "custom-call" and "fmha" in target:
                m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', inst.attrs)
                head = _ARRAY.search(inst.shape)  # the first result: the output (forward) or dQ, [..., H]
                if m and head:
                    pairs = math.prod(int(d) for d in re.findall(r"\d+", m.group(1)))  # B N T S
                    total += (10 if "Backward" in target else 4) * pairs * int(head.group(2).split(",")[-1])
        return total

    def loops(self, comp: str | None = None) -> list[tuple[Instruction, str]]:
        """Every while instruction reachable from ``comp`` (default: the entry), with the
        computation holding it, outermost first."""
        comp = comp or self.entry
        out = []
        for inst in self.comps[comp]:
            if inst.opcode == "while":
                out.append((inst, comp))
                out += self.loops(inst.attr("body"))
            elif inst.opcode in ("call", "conditional") and (inst.attr("to_apply") or "") in self.comps:
                out += self.loops(inst.attr("to_apply"))
        return out

    def collectives(self, comp: str | None = None, times: int = 1, out: dict | None = None) -> dict:
        """{kind: {"count", "bytes"}} per execution of ``comp``: known-trip-count loops multiplied,
        other loops' bodies counted once (per iteration)."""
        comp = comp or self.entry
        out = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES} if out is None else out
        for inst in self.comps[comp]:
            if inst.opcode == "while":
                self.collectives(inst.attr("body"), times * (trip_count(inst, self.comps) or 1), out)
            elif inst.opcode in ("call", "conditional") and (inst.attr("to_apply") or "") in self.comps:
                self.collectives(inst.attr("to_apply"), times, out)
            else:
                kind = next((k for k in COLLECTIVES if inst.opcode in (k, f"{k}-start")), None) or dcn_kind(inst)
                if kind:
                    slot = out.setdefault(kind, {"count": 0, "bytes": 0.0})
                    slot["count"] += times
                    slot["bytes"] += times * (_result_bytes(inst) if kind in COLLECTIVES else _first_array_bytes(inst))
        return out


def dcn_kind(inst: Instruction) -> str | None:
    """``"dcn all-reduce"`` (``dcn all-gather``, ...) for the receiving half of a collective between
    TPU slices: XLA:TPU lowers one to a host-transfer ``send``/``recv`` pair that the megascale
    runtime carries over the data-center network; the payload is the first array of the
    ``recv``'s result (a u32 context and a token follow it). Else None."""
    if inst.opcode != "recv" or "xla_megascale_runtime" not in inst.attrs:
        return None
    m = re.search(r'_xla_megascale_transfer_type="(\w+)"', inst.attrs)
    return "dcn " + (m.group(1).lower().replace("_", "-") if m else "transfer")


def _first_array_bytes(inst: Instruction) -> float:
    m = _ARRAY.search(inst.shape)
    return shape_bytes(m.group(0)) if m else 0.0


def _elements(shape: str) -> int:
    """Elements of an HLO array shape (a tuple's first array)."""
    m = _ARRAY.search(shape)
    return math.prod(int(d) for d in m.group(2).split(",") if d) if m else 0


def _param_number(inst: Instruction) -> int | None:
    m = re.match(r"\s*(\d+)", inst.args)
    return int(m.group(1)) if m else None


def _result_bytes(inst: Instruction) -> float:
    """A collective's payload, its result. An async start's tuple holds its operands and results:
    ``((operands...), (results...))`` for an all-gather (the second half of its arrays), ``((operand),
    result)`` for a reduce-scatter or an all-to-all, and ``(operand, result, u32[], u32[])`` for a
    collective-permute (the second array: the two u32 scalars are its context). An all-reduce's start
    is shaped as its results."""
    if not (inst.opcode.endswith("-start") and inst.shape.startswith("(")) or inst.opcode == "all-reduce-start":
        return shape_bytes(inst.shape)
    arrays = _ARRAY.findall(inst.shape)
    size = lambda a: DTYPE_BYTES.get(a[0], 0) * math.prod(int(d) for d in a[1].split(",") if d)
    if inst.opcode == "collective-permute-start":
        return size(arrays[1])
    return sum(size(a) for a in arrays[len(arrays) // 2:])


# ---- XLA:GPU thunk sequences (``xla_dump_to``: *.thunk_sequence_after_thunk_passes.txt) ----

@dataclasses.dataclass
class Thunk:
    kind: str
    name: str
    children: list["Thunk"] = dataclasses.field(default_factory=list)
    sections: dict[str, list["Thunk"]] = dataclasses.field(default_factory=dict)  # kWhile: condition, body


def parse_thunks(text: str) -> list[Thunk]:
    """The thunk tree of a dumped sequence: indentation nests a command buffer's commands and a
    while loop's condition and body."""
    root: list[Thunk] = []
    stack: list[tuple[int, list[Thunk], Thunk | None]] = [(-1, root, None)]
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        section = re.match(r"\s*(condition|body):\s*$", line)
        while len(stack) > 1 and indent <= stack[-1][0] and not (section and stack[-1][2] is not None):
            stack.pop()
        if section:
            owner = next(t for _, _, t in reversed(stack) if t is not None and t.kind == "kWhile")
            while stack[-1][2] is not owner:
                stack.pop()
            items: list[Thunk] = []
            owner.sections[section.group(1)] = items
            stack.append((indent, items, None))
            continue
        m = re.match(r"\s*\d+:\s+(k\w+)\s+\[[^\]]*\]\s*(\S*)", line)
        if not m:
            continue
        thunk = Thunk(m.group(1), m.group(2))
        while len(stack) > 1 and indent <= stack[-1][0]:
            stack.pop()
        stack[-1][1].append(thunk)
        stack.append((indent, thunk.children, thunk))
    return root


def launches(thunks: list[Thunk]) -> dict[str, int]:
    """Launches of one pass over ``thunks`` (loops not entered): kernels and library calls
    outside command buffers, command buffers (each one launch), and the kernels inside them."""
    out = {"kernels": 0, "command_buffers": 0, "kernels_in_command_buffers": 0, "loops": 0}
    for t in thunks:
        if t.kind == "kCommandBuffer":
            out["command_buffers"] += 1
            out["kernels_in_command_buffers"] += sum(1 for c in _flatten(t.children) if c.kind != "kCommandBuffer")
        elif t.kind == "kWhile":
            out["loops"] += 1
        elif t.kind in ("kSequential",):
            for k, v in launches(t.children).items():
                out[k] += v
        else:
            out["kernels"] += 1
    return out


def _flatten(thunks: list[Thunk]) -> list[Thunk]:
    out = []
    for t in thunks:
        out.append(t)
        out += _flatten(t.children)
        for items in t.sections.values():
            out += _flatten(items)
    return out


def family(name: str) -> str:
    """A kernel's name without the numbers XLA gives each fusion or call (``fusion_926`` -> ``fusion``,
    ``decode_matmul__3`` and ``decode_matmul_1.2`` -> ``decode_matmul``)."""
    return re.sub(r"(?:[._]+\d+)+$", "", name)


def kernel_names(thunks: list[Thunk]) -> list[str]:
    """The kernels and library calls of one pass over ``thunks`` in order (command buffers entered,
    loops not), each by its ``family``: the names a program's layers share."""
    out = []
    for t in thunks:
        if t.kind in ("kCommandBuffer", "kSequential"):
            out += kernel_names(t.children)
        elif t.kind != "kWhile":
            out.append(family(t.name or t.kind))
    return out


def layer_kernels(names: list[str], layers: int) -> list[str] | None:
    """One layer's kernels of a step whose ``layers`` layers run straight-line: the kernels from one
    occurrence to the next of the first name that occurs exactly once per layer, taken at the
    second layer (the first can hold the step's own kernels). None under 3 layers or when no name
    occurs once per layer."""
    if layers < 3:
        return None
    counts = collections.Counter(names)
    marker = next((n for n in names if counts[n] == layers), None)
    if marker is None:
        return None
    at = [i for i, n in enumerate(names) if n == marker]
    return names[at[1]:at[2]]


def while_bodies(thunks: list[Thunk]) -> list[list[Thunk]]:
    """The bodies of the while thunks, outermost first (depth-first)."""
    out = []
    for t in thunks:
        if t.kind == "kWhile":
            body = t.sections.get("body", [])
            out.append(body)
            out += while_bodies(body)
        out += while_bodies(t.children)
    return out


def read_dump(folder: Path, module: str) -> str | None:
    """The thunk sequence XLA:GPU dumped for ``module`` (its jit name) in ``folder``, if any."""
    found = sorted(Path(folder).glob(f"*jit_{module}*thunk_sequence_after_thunk_passes.txt"))
    return found[-1].read_text() if found else None
