"""What each instruction of a compiled (scheduled) HLO module computes and moves: matrix-product
FLOPs and the bytes of its operands and results, and the seconds a step's compute takes at rates
the caller gives. Collectives cost nothing here; hlo.py reads them and their windows.

Bytes count whole operands and results, except where an instruction (or a fusion's root) is a
dynamic-slice of an operand, which reads only the slice, or a dynamic-update-slice into one, which
updates the buffer in place: the update is written, not the whole buffer. FLOPs count dots
and convolutions (in fusions too), not elementwise work, which memory bounds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from gspmd_tp.sharding import hlo

_SIMPLE_SHAPE = re.compile(r"^(pred|bf16|[subfc]\d+)\[([\d,]*)\]")
_NO_COST = hlo.NO_WORK | {"copy-start", "copy-done"}
_GEMM = re.compile(r'custom_call_target="[^"]*(gemm|matmul)', re.IGNORECASE)  # cuBLAS, cuBLASLt
_PARAMETER = re.compile(r"^\d+\)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")  # the computation a fusion calls


def _dims(type_text: str) -> list[int]:
    m = _SIMPLE_SHAPE.match(type_text.strip())
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _product_flops(op: str, result: str, rest: str, types: dict[str, str]) -> float:
    """FLOPs of one dot or convolution: 2 x result elements x contracted elements."""
    names = hlo.operands(rest)
    out = math.prod(_dims(result.lstrip("(")))  # a GEMM custom call's (result, workspace): the first
    if op in ("dot", "custom-call"):
        lhs = _dims(types.get(names[0], "")) if names else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        if m:
            contracted = [int(i) for i in m.group(1).split(",") if i]
        else:  # a GEMM custom call's backend_config: "lhs_contracting_dimensions":["1"]
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
            contracted = [int(i) for i in re.findall(r"\d+", m.group(1))] if m else []
        return 2.0 * out * math.prod(lhs[i] for i in contracted if i < len(lhs))
    kernel = _dims(types.get(names[1], "")) if len(names) > 1 else []
    m = re.search(r"dim_labels=\w+_(\w+)->", rest)
    out_features = kernel[m.group(1).index("o")] if m and "o" in m.group(1) and kernel else 1
    return 2.0 * out * math.prod(kernel) / max(out_features, 1)


def _dimension_numbers(rest: str) -> dict[str, tuple[int, ...]]:
    """A dot's contracting and batch dimensions, each side's."""
    out = {}
    for side in ("lhs", "rhs"):
        for what in ("contracting", "batch"):
            m = re.search(rf"{side}_{what}_dims=\{{([\d,]*)\}}", rest)
            out[f"{side}_{what}"] = tuple(int(i) for i in m.group(1).split(",") if i) if m else ()
    return out


def product_key(lhs_type: str, rhs_type: str, dims: dict[str, tuple[int, ...]]) -> str:
    """How a calibration names a dot: its operands' types (layouts dropped) and its dimensions,
    "f32[2048,256] f32[256,512] lhs_contracting=1 lhs_batch= rhs_contracting=0 rhs_batch="."""
    types = " ".join(m.group(0) if (m := _SIMPLE_SHAPE.match(t.strip())) else t for t in (lhs_type, rhs_type))
    return " ".join([types, *(f"{k}={','.join(map(str, v))}" for k, v in dims.items())])


def parse_product_key(key: str) -> tuple[str, list[int], str, list[int], dict[str, tuple[int, ...]]]:
    """(lhs dtype, lhs dims, rhs dtype, rhs dims, dimension numbers) of a product_key."""
    lhs, rhs, *rest = key.split(" ")
    dtype = lambda t: _SIMPLE_SHAPE.match(t).group(1)  # noqa: E731
    dims = {k: tuple(int(i) for i in v.split(",") if i) for k, _, v in (r.partition("=") for r in rest)}
    return dtype(lhs), _dims(lhs), dtype(rhs), _dims(rhs), dims


class Costs:
    """The instructions of one HLO module, parsed once: flops_and_bytes per instruction, and
    seconds() of a computation (loops and calls inside it included) at given rates."""

    def __init__(self, text: str):
        self.comps, self.entry = hlo.computations(text)
        self.parsed = {
            c: [m.groups() for line in lines if (m := hlo.INSTRUCTION.match(line))]
            for c, lines in self.comps.items()
        }
        self.types = {c: {name: t for name, t, _, _ in instrs} for c, instrs in self.parsed.items()}
        # Computations that hold a collective and compute nothing: the instructions calling them
        # transfer (a TPU continuation fusion that also computes costs what it computes).
        self.transfers = {c for c, lines in self.comps.items() if hlo.transfer_only(lines)}
        self._products: dict[str, list[tuple[str, str, str, str]]] = {}
        self._sliced: dict[str, tuple[int, int] | None] = {}

    def _slicing(self, comp: str) -> tuple[int, int] | None:
        """(bytes not moved, bytes moved instead) where computation `comp`'s root is a
        dynamic-slice of one of its parameters (the rest of that operand is not read) or a
        dynamic-update-slice into one (in place: the update is written, the buffer neither read
        nor written whole); None otherwise."""
        if comp not in self._sliced:
            self._sliced[comp] = None
            instrs = {name: (result, op, rest) for name, result, op, rest in self.parsed.get(comp, [])}
            root = next((line for line in self.comps.get(comp, []) if line.lstrip().startswith("ROOT")), "")
            m = hlo.INSTRUCTION.match(root)
            result, op, rest = m.groups()[1:] if m else ("", "", "")
            while op == "bitcast" and hlo.operands(rest)[0] in instrs:  # a bitcast moves nothing
                result, op, rest = instrs[hlo.operands(rest)[0]]
            if op in ("dynamic-slice", "dynamic-update-slice"):
                names = hlo.operands(rest)
                buffer = instrs.get(names[0] if names else "")
                in_place = bool(buffer and buffer[1] == "parameter" and _PARAMETER.match(buffer[2]))
                if in_place and op == "dynamic-slice":
                    self._sliced[comp] = (hlo.shape_bytes(buffer[0]), hlo.shape_bytes(result))
                elif in_place and len(names) > 1:
                    update = hlo.shape_bytes(self.types[comp].get(names[1], ""))
                    # not the buffer read and the result written whole: the update written (what it
                    # is made of is read as the fusion's other operands)
                    self._sliced[comp] = (2 * hlo.shape_bytes(result), update)
        return self._sliced[comp]

    def _fused_products(self, comp: str) -> list[tuple[str, str, str, str]]:
        """(computation, op, result, rest) of every dot and convolution inside fused computation
        `comp`, nested fusions included."""
        if comp not in self._products:
            found = []
            for _, result, op, rest in self.parsed.get(comp, []):
                if op in ("dot", "convolution"):
                    found.append((comp, op, result, rest))
                elif op == "fusion" and (m := _CALLS.search(rest)):
                    found += self._fused_products(m.group(1))
            self._products[comp] = found
        return self._products[comp]

    def _called_flops(self, comp: str) -> float:
        """Matrix-product FLOPs inside a fused computation (nested fusions included)."""
        found = self._fused_products(comp)
        return sum((_product_flops(op, result, rest, self.types[c]) for c, op, result, rest in found), 0.0)

    def _dot_key(self, comp: str, rest: str) -> str:
        """product_key of the dot of `comp` whose operands and attributes are `rest`."""
        names = hlo.operands(rest)
        return product_key(*(self.types[comp].get(n, "") for n in names[:2]), _dimension_numbers(rest))

    def product_keys(self, comp: str, index: int) -> list[str]:
        """product_key of each dot instruction `index` of `comp` computes: itself, or those of the
        fusion it calls (none for a GEMM custom call or a convolution)."""
        _, _, op, rest = self.parsed[comp][index]
        if op == "dot":
            return [self._dot_key(comp, rest)]
        called = _CALLS.search(rest)
        if op != "fusion" or not called:
            return []
        return [self._dot_key(c, r) for c, o, _, r in self._fused_products(called.group(1)) if o == "dot"]

    def all_product_keys(self) -> set[str]:
        """product_key of every dot of the module, in the computations the step runs and the
        fusions they call."""
        return {
            self._dot_key(c, rest)
            for c, instrs in self.parsed.items()
            for _, _, op, rest in instrs
            if op == "dot"
        }

    def flops_and_bytes(self, comp: str, index: int) -> tuple[float, float]:
        """(matrix-product FLOPs, bytes read and written) of one run of instruction `index` of
        `comp`, not counting what a loop or call it makes does (seconds() adds that)."""
        name, result, op, rest = self.parsed[comp][index]
        called = _CALLS.search(rest)
        if (
            op in _NO_COST
            or op in ("while", "call", "conditional")
            or op.removesuffix("-start").removesuffix("-done") in hlo.KINDS
            or op.startswith("async-")
            or (called and called.group(1) in self.transfers)
        ):
            return 0.0, 0.0
        types = self.types[comp]
        moved = hlo.shape_bytes(result) + sum(hlo.shape_bytes(types.get(o, "")) for o in hlo.operands(rest))
        names = hlo.operands(rest)
        if op == "dynamic-slice" and names:  # the slice read, not the whole operand
            moved -= hlo.shape_bytes(types.get(names[0], "")) - hlo.shape_bytes(result)
        elif op == "dynamic-update-slice" and len(names) > 1:  # in place: the update read and written
            moved += hlo.shape_bytes(types.get(names[1], "")) - 2 * hlo.shape_bytes(result)
        elif op == "fusion" and called and (sliced := self._slicing(called.group(1))):
            moved += sliced[1] - sliced[0]
        if op in ("dot", "convolution") or (op == "custom-call" and _GEMM.search(rest)):
            return _product_flops(op, result, rest, types), moved
        if op == "fusion" and called:
            return self._called_flops(called.group(1)), moved
        return 0.0, moved

    def seconds(
        self,
        seconds_of: Callable[[float, float], float],
        comp: str | None = None,
        products: Callable[[list[str]], float | None] | None = None,
    ) -> tuple[float, dict[tuple[str, str], float]]:
        """(seconds of one run of `comp`, the entry unless given, and {(computation, instruction):
        seconds of one run of it}), each instruction costing seconds_of(flops, bytes); a while loop
        costs its body times its trip count, a call its computation, a conditional its dearest
        branch. Where `products` gives the seconds of an instruction's dots (from their
        product_keys; None where it has no figure for them), those replace the FLOPs' share."""
        per: dict[tuple[str, str], float] = {}

        def run(c: str) -> float:
            total = 0.0
            for i, (name, _, op, rest) in enumerate(self.parsed.get(c, [])):
                if op == "while":
                    body = re.search(r"\bbody=%?([\w.\-]+)", rest)
                    trips = hlo.trip_count(_line(self.comps[c], name), self.comps)
                    t = trips * run(body.group(1)) if body else 0.0
                elif op == "call":
                    m = re.search(r"\bto_apply=%?([\w.\-]+)", rest)
                    t = run(m.group(1)) if m else 0.0
                elif op == "conditional":
                    m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                    branches = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []
                    t = max((run(b) for b in branches), default=0.0)
                else:
                    flops, moved = self.flops_and_bytes(c, i)
                    measured = products(self.product_keys(c, i)) if products and flops else None
                    if measured is not None:
                        t = measured + (seconds_of(0.0, moved) if moved else 0.0)
                    else:
                        t = seconds_of(flops, moved) if flops or moved else 0.0
                per[c, name] = t
                total += t
            return total

        return run(comp or self.entry), per


def _line(lines: list[str], name: str) -> str:
    """The line of `lines` that defines instruction `name`."""
    for line in lines:
        m = hlo.INSTRUCTION.match(line)
        if m and m.group(1) == name:
            return line
    raise KeyError(name)
