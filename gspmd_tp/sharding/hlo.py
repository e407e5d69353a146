"""Collectives and the bytes they move, read from compiled (post-SPMD-partitioning) HLO text.

Counts go through loops: a collective inside a while body counts once per iteration, with the trip
count read from the loop's backend_config (`known_trip_count`) or, failing that, from the constant
its condition compares the induction variable against.

Each collective also carries its window in the compiled schedule: the compute instructions the
compiler placed between its start and its done (asynchronous pairs such as all-gather-start /
all-gather-done, async-start / async-done, and the TPU's start, continuation and done fusions). A
synchronous collective (every one XLA:CPU emits) has none: its bytes are exposed.

Where the devices sit in islands joined by a slower network (GPU hosts, TPU slices), each collective
also says how many islands its groups span: the TPU compiler writes a multi-slice program's
data-center-network (DCN) collectives as host-transfer sends to the "megascale" runtime, which are
counted here as collectives of their own across the slices.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

import numpy as np

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
# One instruction: (name, result type, opcode, the rest after the opcode's "(").
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b(pred|bf16|[subfc]\d+)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(body|condition|to_apply|calls)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program."""

    kind: str
    name: str
    computation: str
    # bytes of the result on one device (all tuple elements); of a ragged-all-to-all, its payload:
    # the input buffer it sends from (its result is the buffer it receives into, sized for the most)
    result_bytes: int
    group_size: int  # devices taking part in each group
    executions: int  # times it runs per call of the program (loop trip counts applied)
    op_name: str = ""  # the jax operation it came from (HLO metadata), to trace it to the model
    islands: int = 1  # the most islands (GPU hosts, TPU slices) one of its groups spans
    per_island: int = 0  # where islands > 1: the fewest devices of one group in one island
    dtype: str = ""  # the element type(s) the program asked for, "bf16" or "bf16,f32" (a tuple)
    promoted: bool = False  # a bf16 all-reduce XLA:CPU runs in f32 (result_bytes: the f32 it moves)
    # The compute instructions the schedule places between its start and its done, in `scheduled_in`
    # (the computation that runs them); () for a synchronous collective.
    window: tuple[str, ...] = ()
    scheduled_in: str = ""

    @property
    def hidden(self) -> bool:
        """Whether the schedule gives it compute to run beside (an asynchronous pair with work between)."""
        return bool(self.window)

    @property
    def ring_bytes(self) -> float:
        """Bytes one device sends per execution under a ring (bandwidth-optimal) algorithm."""
        g, r = self.group_size, self.result_bytes
        if g <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (g - 1) / g * r
        if self.kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
            # a ragged-all-to-all's sizes are known at run time alone: its payload split evenly
            return (g - 1) / g * r
        if self.kind == "reduce-scatter":
            return (g - 1) * r  # the operand is g times the result
        return float(r)  # collective-permute: the whole buffer to one peer

    @property
    def ring_bytes_per_call(self) -> float:
        """Bytes one device sends per call of the program: ring_bytes times its executions."""
        return self.ring_bytes * self.executions


def shape_bytes(text: str) -> int:
    """Total bytes of every array shape written in `text` (e.g. a tuple result type)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * DTYPE_BYTES.get(dtype, 4)
    return total


def dtypes(text: str) -> str:
    """The distinct element types of the shapes written in `text`, in order: "f32", "bf16,f32"."""
    return ",".join(dict.fromkeys(dtype for dtype, _ in _SHAPE.findall(text)))


# XLA:CPU runs a bf16 all-reduce in f32 (all-reduce-promotion), renaming its reduction computation.
_PROMOTED = re.compile(r"to_apply=%?[\w.\-]*_promoted\b")


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """HLO's iota device list "[4,2]T(1,0)": 0..N-1 laid out in `dims`, transposed by `perm`, flattened."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return (ids.transpose([int(p) for p in perm.split(",")]) if perm else ids).ravel()


def replica_groups(attributes: str, num_devices: int) -> list[tuple[int, ...]]:
    """The device groups of a collective, from any of the HLO spellings of replica_groups (explicit
    lists, iota "[G,S]<=[dims]T(perm)", mesh['x'=2,'y'=4] {'y'}) or a permute's source-target pairs.
    In the partitioned programs compiled here the ids are partition ids: positions in the mesh's
    device list."""
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if m:
        groups = [tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        groups = [g for g in groups if g]
        return groups or [tuple(range(num_devices))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if m:
        ids = _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2)))
        return [tuple(int(i) for i in row) for row in ids]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}", attributes)
    if m:
        sizes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        listed = re.findall(r"'([^']+)'", m.group(3))
        order = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", m.group(2))
        ids = _iota(*order.groups()) if order else np.arange(math.prod(n for _, n in sizes))
        ids = ids.reshape([n for _, n in sizes])
        names = [a for a, _ in sizes]
        # The group runs along the listed axes: move them last, one group per row.
        kept = [i for i, a in enumerate(names) if a not in listed] + [names.index(a) for a in listed]
        width = math.prod(n for a, n in sizes if a in listed)
        return [tuple(int(i) for i in row) for row in ids.transpose(kept).reshape(-1, width)]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    if m:
        return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return [tuple(range(num_devices))]


def group_size(attributes: str, num_devices: int) -> int:
    """Devices per replica group, from any of the HLO spellings of replica_groups."""
    return len(replica_groups(attributes, num_devices)[0])


def _spread(groups: list[tuple[int, ...]], island_of) -> tuple[int, int]:
    """(the most islands one group spans, the fewest devices of such a group in one island)."""
    spans, fewest = 1, 0
    for g in groups:
        counts = np.bincount([island_of[i] for i in g])
        counts = counts[counts > 0]
        if len(counts) > 1:
            spans = max(spans, len(counts))
            fewest = min(fewest or int(counts.min()), int(counts.min()))
    return spans, fewest


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines, in schedule order}, the entry's name)."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def trip_count(line: str, comps: dict[str, list[str]]) -> int:
    """The trip count of the while loop on `line`: its known_trip_count, else its condition's bound."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", line)
    for body_line in comps.get(cond.group(1), []) if cond else []:
        c = re.search(r"constant\((\d+)\)", body_line)
        if c:
            return int(c.group(1))
    raise ValueError(f"cannot read the trip count of while loop: {line.strip()[:200]}")


def executions(text: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation."""
    comps, entry = computations(text)
    counts: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for line in comps.get(name, []):
            trips = trip_count(line, comps) if re.search(r"\swhile\(", line) else 1
            for m in _CALLEES.finditer(line):
                keyword, callee, branches = m.groups()
                for name_ in [callee] if callee else re.findall(r"%?([\w.\-]+)", branches):
                    if name_ in comps:
                        visit(name_, times * (trips if keyword == "body" else 1))

    visit(entry, 1)
    return counts


def _op_name(attributes: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attributes)
    return m.group(1) if m else ""


# Where a profiled step's time goes, by what each instruction computes.
GROUPS = ("matrix products", "collectives", "copies, transposes", "broadcasts", "other elementwise")


def classify(text: str) -> dict[str, str]:
    """Each instruction of a compiled HLO module -> one of GROUPS. A fusion is a matrix product
    when its computation holds a dot or a convolution (elementwise work fused into it included);
    otherwise it goes by the ops XLA named it after. Loops and calls are left out: their bodies'
    instructions are classified themselves."""
    comps, _ = computations(text)
    opcodes = {
        c: {m.group(3) for line in lines if (m := INSTRUCTION.match(line))} for c, lines in comps.items()
    }
    out = {}
    for lines in comps.values():
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m or m.group(3) in ("while", "conditional", "call"):
                continue
            name, _, opcode, rest = m.groups()
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            ops = opcodes.get(called.group(1), set()) | {opcode} if called else {opcode}
            if any(op.removesuffix("-start") in KINDS for op in ops):
                out[name] = "collectives"
            elif ops & {"dot", "convolution"}:
                out[name] = "matrix products"
            elif "copy" in name or "transpose" in name or opcode in ("copy", "transpose"):
                out[name] = "copies, transposes"
            elif "broadcast" in name or opcode == "broadcast":
                out[name] = "broadcasts"
            else:
                out[name] = "other elementwise"
    return out


_MEGASCALE_TARGET = re.compile(r'_xla_megascale_target="\{([^}]*)\}')
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')


def _megascale(comp: str, lines: list[str], runs: dict[str, int]) -> list[Collective]:
    """The DCN collectives of a multi-slice TPU program: one send to the megascale runtime each
    (its recv, under the same rendezvous name, holds what it produces), across the slices named in
    its target ("{1,2,3,4}x{0:3}": slices 1-4, each device 0-3 of its slice with its peers)."""
    received = {}
    for line in lines:
        m = INSTRUCTION.match(line)
        rendezvous = _RENDEZVOUS.search(line)
        if m and m.group(3) == "recv" and rendezvous:
            received[rendezvous.group(1)] = _SHAPE.findall(m.group(2))[:1]
    found = []
    for line in lines:
        m, target = INSTRUCTION.match(line), _MEGASCALE_TARGET.search(line)
        transfer = _MEGASCALE_TYPE.search(line)
        if not (m and target and transfer and m.group(3) == "send"):
            continue
        slices = 0
        for part in target.group(1).split(","):
            first, _, last = part.partition(":")
            slices += int(last) - int(first) + 1 if last else 1
        rendezvous = _RENDEZVOUS.search(line)
        result = received.get(rendezvous.group(1) if rendezvous else "") or _SHAPE.findall(m.group(2))[:1]
        kind = transfer.group(1).lower().replace("_", "-")
        found.append(
            Collective(
                kind=kind if kind in KINDS else "collective-permute",
                name=m.group(1),
                computation=comp,
                result_bytes=shape_bytes("{}[{}]".format(*result[0])) if result else 0,
                dtype=result[0][0] if result else "",
                group_size=slices,
                executions=runs.get(comp, 0),
                op_name=_op_name(line),
                islands=slices,
                per_island=1,
            )
        )
    return found


# Instructions that compute nothing: plumbing, and the pieces of other transfers.
NO_WORK = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
    "add-dependency", "partition-id", "replica-id", "send", "recv", "send-done", "recv-done",
}  # fmt: skip


# What a computation that only moves a collective's data may hold besides the collective.
_MOVES = NO_WORK | {"copy", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "reshape"}


def transfer_only(lines: list[str]) -> bool:
    """Whether a called computation holds a collective and nothing that computes: a TPU start or
    done fusion, or a fused all-reduce + slice; not a continuation fusion that carries a
    collective's progress beside the products it computes."""
    ops = [m.group(3) for line in lines if (m := INSTRUCTION.match(line))]
    held = [op for op in ops if op.removesuffix("-start").removesuffix("-done") in KINDS]
    return bool(held) and all(op in _MOVES or op in held for op in ops)


def operands(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its opcode's "(" (INSTRUCTION's
    last group)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _windows(comps: dict[str, list[str]], found: list[tuple[Collective, tuple | None]]) -> dict:
    """{(computation, name) of a collective: (computation it is scheduled in, compute instructions
    between its start and its done)}. A collective's anchors are its own instruction where it
    stands in a scheduled computation, else the instructions there that call a computation holding
    it or a copy of it (one key of collectives(): the TPU's start, continuation and done fusions,
    an async-start's wrapped computation); a -done instruction taking an anchor joins them. What lies
    between the first and last anchor and does work is the window."""
    parsed = {
        c: [(m.group(1), m.group(3), m.group(4)) for line in lines if (m := INSTRUCTION.match(line))]
        for c, lines in comps.items()
    }
    called = {}  # computation -> [(caller computation, instruction index)]
    for c, instrs in parsed.items():
        for i, (_, _, rest) in enumerate(instrs):
            m = re.search(r"\bcalls=%?([\w.\-]+)", rest)
            if m:
                called.setdefault(m.group(1), []).append((c, i))
    by_key: dict[tuple, set[str]] = defaultdict(set)
    for c, key in found:
        if key is not None:
            by_key[key].add(c.computation)
    # Every instruction that starts, continues or ends some collective: not compute.
    transfer = {(c.computation, c.name) for c, _ in found}
    transfer |= {
        (comp, parsed[comp][i][0])
        for c, _ in found
        if transfer_only(comps[c.computation])
        for comp, i in called.get(c.computation, [])
    }
    out = {}
    for c, key in found:
        holders = by_key[key] if key is not None else {c.computation}
        if c.computation not in called:  # it stands in a scheduled computation itself
            sched = c.computation
            anchors = {i for i, (name, _, _) in enumerate(parsed[sched]) if name == c.name}
        else:
            places = [where for h in holders for where in called.get(h, [])]
            sched = places[0][0]
            anchors = {i for comp, i in places if comp == sched}
        names = {parsed[sched][i][0] for i in anchors}
        for i, (name, op, rest) in enumerate(parsed[sched]):
            if op.endswith("-done") and set(operands(rest)) & names:
                anchors.add(i)
                names.add(name)
        first, last = min(anchors), max(anchors)
        between = [
            name
            for i, (name, op, _) in enumerate(parsed[sched][first : last + 1], first)
            if i not in (first, last)
            and (sched, name) not in transfer
            and op not in NO_WORK
            and not op.endswith(("-start", "-update", "-done"))
        ]
        out[c.computation, c.name] = (sched, tuple(between))
    return out


def device_islands(devices, host_of_process=None) -> list[int] | None:
    """For `collectives`: the island (host) of each partition id of a program over `devices` (the
    mesh's, in order), each device on the host `host_of_process[d.process_index]` (without it, each
    process on a host of its own); None where they all sit on one, or on TPU, whose compiler
    writes the transfers between slices itself."""
    devices = list(devices)
    hosts = [d.process_index for d in devices]
    if host_of_process is not None:
        hosts = [host_of_process[p] for p in hosts]
    return hosts if devices[0].platform != "tpu" and len(set(hosts)) > 1 else None


def collectives(text: str, num_devices: int, island_of=None) -> list[Collective]:
    """Every collective of the program with its bytes, group size and execution count.

    One collective, one entry: the TPU compiler splits an asynchronous collective into a start
    fusion and continuation fusions (async_collective_fusion) that each hold a copy of the
    instruction with the same channel_id; one copy is counted, the most executed. Other collectives
    of a channel_id (a shard_map's share one) are counted each. `island_of`
    maps a partition id to its island (a GPU's host) where the devices sit in several; a
    multi-slice TPU program's DCN transfers are counted across its slices whatever it is.
    """
    comps, _ = computations(text)
    runs = executions(text)
    found: list[tuple[Collective, tuple | None]] = []
    for comp, lines in comps.items():
        # An asynchronous collective's start returns its operands beside its results; the done
        # instruction returns the results alone, so its type is what the collective produces.
        done, types = {}, {}
        for line in lines:
            m = INSTRUCTION.match(line)
            if m:
                types[m.group(1)] = m.group(2)
            if m and m.group(3).endswith("-done"):
                operand = re.match(r"\s*%?([\w.\-]+)", m.group(4))
                done[operand.group(1) if operand else ""] = m.group(2)
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            name, result_type, op, rest = m.groups()
            kind = op.removesuffix("-start")
            if kind not in KINDS or op.endswith("-done"):
                continue
            result = done.get(name, result_type) if op.endswith("-start") else result_type
            if op.endswith("-start") and name not in done and kind in ("all-gather", "collective-permute"):
                # (operand, result[, ...]) tuples with no done beside them: the result is the second.
                shapes = _SHAPE.findall(result_type)
                result = "{}[{}]".format(*shapes[1]) if len(shapes) > 1 else result_type
            if kind == "ragged-all-to-all":  # the payload: its first operand, the rows it sends from
                sent = operands(rest)
                result = types.get(sent[0], result) if sent else result
            groups = replica_groups(rest, num_devices)
            size, dtype = shape_bytes(result), dtypes(result)
            promoted = kind == "all-reduce" and dtype == "f32" and bool(_PROMOTED.search(rest))
            dtype = "bf16" if promoted else dtype
            spans, per_island = _spread(groups, island_of) if island_of is not None else (1, 0)
            if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
                # The TPU compiler writes a reduce-scatter as a fused all-reduce + dynamic-slice
                # computation named all-reduce-scatter; it moves what a reduce-scatter moves.
                kind, size = "reduce-scatter", size // len(groups[0])
            c = Collective(
                kind=kind,
                name=name,
                computation=comp,
                result_bytes=size,
                group_size=len(groups[0]),
                executions=runs.get(comp, 0),
                op_name=_op_name(rest),
                islands=spans,
                per_island=per_island,
                dtype=dtype,
                promoted=promoted,
            )
            # Copies of one collective (the TPU's async fusions) share its channel_id and chain_id and
            # are alike; distinct collectives may share a channel_id too (a shard_map's all do).
            channel = re.search(r"\bchannel_id=(\d+)", rest)
            chain = re.search(r'\bchain_id="(\d+)"', rest)
            key = (channel.group(1), chain and chain.group(1), kind, size, str(groups), c.op_name)
            found.append((c, key if channel else None))
    windows = _windows(comps, found)
    found = [
        (dataclasses.replace(c, scheduled_in=windows[c.computation, c.name][0],
                             window=windows[c.computation, c.name][1]), key)
        for c, key in found
    ]  # fmt: skip
    # Copies sit in different computations (start, continuation and done fusions): of a channel's
    # alike collectives, as many are counted as one computation holds, the most executed.
    alike: dict[tuple, list[Collective]] = defaultdict(list)
    for c, key in found:
        if key is not None:
            alike[key].append(c)
    kept = set()
    for group in alike.values():
        most = max(Counter(c.computation for c in group).values())
        kept |= {id(c) for c in sorted(group, key=lambda c: -c.executions)[:most]}
    dcn = [c for comp, lines in comps.items() for c in _megascale(comp, lines, runs)]
    return [c for c, key in found if key is None or id(c) in kept] + dcn


def as_asked(found: list[Collective]) -> list[Collective]:
    """The collectives counted in the dtypes the program asked for: a bf16 all-reduce XLA:CPU
    promoted at half the f32 bytes it moves (a float32 scalar the compiler combined into it counts
    2 bytes short)."""
    return [
        dataclasses.replace(c, result_bytes=c.result_bytes // 2, promoted=False) if c.promoted else c
        for c in found
    ]


def network_bytes(found: list[Collective]) -> float:
    """Bytes per device per program call of the collectives whose groups span islands (GPU hosts,
    TPU slices): what crosses the network."""
    return sum(c.ring_bytes_per_call for c in found if c.islands > 1)


def exposure(found: list[Collective]) -> dict[str, float]:
    """Ring bytes per device per program call that the schedule leaves exposed (no compute between
    the collective's start and its done) and that it hides (some compute there: hidden only as far
    as that compute lasts, which the estimate weighs)."""
    hidden = sum(c.ring_bytes_per_call for c in found if c.hidden)
    return {"exposed": sum(c.ring_bytes_per_call for c in found) - hidden, "hidden": hidden}


def summarize(found: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {count, bytes, ring_bytes_per_device, dtypes}} per program call, every kind present;
    dtypes lists the element types its collectives carry."""
    out = {k: {"count": 0, "bytes": 0, "ring_bytes_per_device": 0.0, "dtypes": []} for k in KINDS}
    for c in found:
        for dtype in c.dtype.split(","):
            if dtype and dtype not in out[c.kind]["dtypes"]:
                out[c.kind]["dtypes"].append(dtype)
        out[c.kind]["count"] += c.executions
        out[c.kind]["bytes"] += c.result_bytes * c.executions
        out[c.kind]["ring_bytes_per_device"] += c.ring_bytes_per_call
    return out
