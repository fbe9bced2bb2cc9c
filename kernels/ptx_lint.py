"""PTX lint: warp-collective instructions where only some lanes of a warp can be.

A full-mask `shfl.sync` (CuTeDSL's `warp_idx()` is one), `vote.sync`, `match.sync`, `redux.sync` or
`bar.warp.sync`, or a `.aligned` warp instruction (`mma.sync`, `ldmatrix`, `wgmma`, `bar.sync`), needs every
lane of the warp to execute it together; placed under a branch that depends on the lane (`if lane_idx() == 0`,
`if tidx == 0`) it hangs the GPU or gives undefined results, and nothing on a CPU notices. This reads the PTX
ptxas gets and reports each such instruction, by a conservative taint analysis:

- lane-variant values come from %laneid, %lanemask_* and %tid.x; %tid.x shifted right by >= 5 bits, divided
  by a multiple of 32 or masked by a multiple of 32 is warp-uniform (a warp index), as is a `shfl.sync.idx`
  from a constant lane; anything computed from a variant value is variant (flow-insensitive: a register is
  variant if any of its definitions is);
- a predicate is variant if set from a variant value, except %tid.x against a multiple of 32 (`tidx < 128`
  selects whole warps);
- a branch on a variant predicate makes a divergent region: a forward branch, the instructions it skips (and
  the else block after them, when they end in a jump over it); a backward branch, the loop body.

It over-approximates (a divergent region ends at its label, not where ptxas proves reconvergence), so a
finding is a line to read; none of the kernels has one (test_kernels_compile).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_FULL_MASK = {"-1", "0xffffffff", "0xFFFFFFFF", "4294967295"}
_MASKED = ("shfl.sync", "vote.sync", "match.sync", "redux.sync", "bar.warp.sync")       # membermask operand
_ALIGNED = ("mma.sync.aligned", "ldmatrix.sync.aligned", "stmatrix.sync.aligned", "wgmma.", "bar.sync",
            "barrier.sync.aligned")
_LANE_SOURCES = ("%laneid", "%lanemask_")
_TID = "%tid.x"
_REG = re.compile(r"%[A-Za-z_][\w.]*")
_LABEL = re.compile(r"^(\$?[\w.$]+):$")
_ENTRY = re.compile(r"^\.(?:visible\s+)?\.?(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$.]+)")

U, T, V = 0, 1, 2              # warp-uniform, %tid.x itself, lane-variant


@dataclass(frozen=True)
class Finding:
    function: str
    line: int
    instruction: str
    branch_line: int

    def __str__(self) -> str:
        return (f"{self.function}: line {self.line}: `{self.instruction}` is a warp collective under the "
                f"lane-dependent branch of line {self.branch_line}")


@dataclass
class _Instr:
    line: int
    text: str
    op: str
    args: list[str]
    guard: str | None = None       # the predicate register of `@%p` / `@!%p`


def _functions(ptx: str):
    """(name, [(line, statement or label)]) for each .entry / .func body."""
    name, depth, body, out = None, 0, [], []
    for lineno, raw in enumerate(ptx.splitlines(), 1):
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        m = _ENTRY.match(line)
        if m and depth == 0:
            name, body = m.group(1), []
        if name is None:
            continue
        for ch in line:
            depth += ch == "{"
            depth -= ch == "}"
        # an inline-asm scope `{ ... }` shares lines with statements; vector operands `{%r1, %r2}` follow an opcode
        for part in line.split(";"):
            part = " ".join(part.split())
            while part[:1] in ("{", "}"):
                part = part[1:].strip()
            if part and not part.startswith("."):
                body.append((lineno, part))
        if depth == 0 and "}" in line:
            out.append((name, body))
            name = None
    return out


def _parse(body) -> tuple[list[_Instr], dict[str, int]]:
    """The instructions, each split into opcode and operands once, and each label's instruction index."""
    instrs, labels = [], {}
    for lineno, text in body:
        m = _LABEL.match(text)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        g = re.match(r"^@!?(%\w+)\s+(.*)$", text)
        guard, text = (g.group(1), g.group(2)) if g else (None, text)
        op, _, rest = text.partition(" ")
        args = [a.strip() for a in rest.split(",")] if rest.strip() else []
        instrs.append(_Instr(lineno, text, op, args, guard))
    return instrs, labels


def _imm(s: str) -> int | None:
    try:
        return int(s, 0)
    except ValueError:
        return None


def _warp_uniform_tid_op(op: str, srcs: list[str], state: dict[str, int]) -> bool:
    """%tid.x against or by a constant that keeps whole warps together: a warp index (tid >> 5, tid / 32,
    tid & ~31) or a test of one (tid < 128)."""
    c = _imm(srcs[1])
    if c is None or not (srcs[0] == _TID or state.get(srcs[0]) == T):
        return False
    if op.startswith("setp"):
        cmp = op.split(".")[1]
        return (cmp in ("lt", "ge") and c % 32 == 0) or (cmp in ("le", "gt") and (c + 1) % 32 == 0)
    return (op.startswith("shr") and c >= 5) or (op.startswith(("div", "and")) and c % 32 == 0)


def _kind_of(op: str, args: list[str], state: dict[str, int]) -> int:
    """The taint of the value an instruction defines (its first operand)."""
    srcs = args[1:]
    if any(s.startswith(_LANE_SOURCES) for s in srcs) or op.startswith("elect.sync"):
        return V
    if op.startswith("mov") and srcs == [_TID]:
        return T
    if op.startswith(("mov", "cvt")) and len(srcs) == 1 and state.get(srcs[0]) == T:
        return T
    if op.startswith("shfl.sync.idx") and len(srcs) >= 2 and _imm(srcs[1]) is not None:
        return U                                                  # broadcast of one lane
    kinds = [state.get(r, U) for s in srcs for r in _REG.findall(s)]
    if _TID in srcs:
        kinds.append(T)
    if not kinds or max(kinds) == U:
        return U
    if max(kinds) == T and len(srcs) == 2 and _warp_uniform_tid_op(op, srcs, state):
        return U
    return V


def _taint(instrs: list[_Instr]) -> dict[str, int]:
    state: dict[str, int] = {}
    changed = True
    while changed:                                  # to a fixed point over loop-carried registers
        changed = False
        for ins in instrs:
            if not ins.args or not ins.args[0].startswith("%") or \
                    ins.op.startswith(("st.", "bra", "bar", "red.", "cp.")):
                continue
            kind = _kind_of(ins.op, ins.args, state)
            if ins.guard is not None and state.get(ins.guard, U) == V:
                kind = max(kind, V)                     # defined only in some lanes
            for d in ins.args[0].split("|"):            # setp's two predicates: %p|%q
                d = d.strip("{} ")
                if kind > state.get(d, U):
                    state[d] = kind
                    changed = True
    return state


def _is_collective(ins: _Instr) -> bool:
    if ins.op.startswith(_MASKED):
        return bool(ins.args) and ins.args[-1] in _FULL_MASK
    return ins.op.startswith(_ALIGNED)


def _divergent_span(i: int, j: int, instrs: list[_Instr], labels: dict[str, int]) -> range:
    """What a lane-dependent branch at i to the label at j makes divergent: backward, the loop body [j, i);
    forward, the skipped block (i, j) and, when that block ends by jumping over an else block, that too."""
    if j <= i:
        return range(j, i)
    last = instrs[j - 1]
    if j - 1 > i and last.op.startswith("bra") and last.guard is None and last.args:
        end = labels.get(last.args[0])
        if end is not None and end > j:
            return range(i + 1, end)
    return range(i + 1, j)


def lint_function(name: str, body) -> list[Finding]:
    instrs, labels = _parse(body)
    state = _taint(instrs)
    divergent: dict[int, int] = {}                      # instruction index -> line of the branch
    for i, ins in enumerate(instrs):
        if ins.op.startswith("bra") and ins.guard is not None and state.get(ins.guard, U) == V and ins.args \
                and ins.args[0] in labels:
            for k in _divergent_span(i, labels[ins.args[0]], instrs, labels):
                divergent.setdefault(k, ins.line)
    out = []
    for i, ins in enumerate(instrs):
        branch = divergent.get(i)
        if ins.guard is not None and state.get(ins.guard, U) == V:
            branch = branch or ins.line
        if branch is not None and _is_collective(ins):
            out.append(Finding(name, ins.line, ins.text, branch))
    return out


def lint_ptx(ptx: str) -> list[Finding]:
    """Every warp collective under a lane-dependent branch, in every function of a PTX module."""
    return [f for name, body in _functions(ptx) for f in lint_function(name, body)]
