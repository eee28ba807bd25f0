"""Hostile values of any declared type, drawn from one `random.Random`.

A wire message or a stored document is generated from its msgspec type (`msgspec.inspect`): every field
gets a value of its own type chosen to hurt (paths that climb out of their root or name a canary outside
it, negative and huge sizes and counts, NaN, empty and very long strings, versions from the future), or,
now and then, a value of another type, a missing field or one more. Messages are built as dicts with
their tag and encoded by msgpack or JSON directly, so a wrong type reaches the peer's decoder as it would
from a hostile sender. The same `Random` gives the same cases: Hypothesis drives it in the tests
(`st.randoms()`), a seed in the benchmark.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect as mi

from outlast.protocol import messages as m
from outlast.protocol.transport import HEADER, MAGIC

LONG = 70_000  # longer than a file name, a path, a line: bounded so that 100,000 cases fit a benchmark


@dataclass(frozen=True)
class Targets:
    """What hostile paths aim at: `canary`, a directory outside every root of the process under test,
    in which nothing may appear, and files outside the roots that nothing may read back."""

    canary: str

    def paths(self) -> list[str]:
        c = self.canary.rstrip("/")
        climb = "../" * 12
        secret = c + "/secret.txt"  # tests/fuzz/doors.py plant_canary: no answer may carry its bytes
        return [
            secret, climb + secret.lstrip("/"), "/etc/hostname", "", ".", "..", "/", "//", "./", "a/..", "../", climb, climb + c.lstrip("/") + "/escaped",
            c + "/escaped", c, c + "/../escaped", "a/../../" + c.lstrip("/"), "x/" + climb + c.lstrip("/") + "/deep/f",
            "/proc/self/environ", "/dev/zero", "/dev/stdout", "~/escaped", "$HOME/escaped",
            "\x00", "a\x00b", "nul\x00/../../x", "a\nb", "\\..\\..\\x", "%2e%2e/%2e%2e/x", "C:\\x", " ", "-rf",
            "a" * 255 + "/b", "a" * 300, "é/ü/☃", "\u202e", "a/" * 200 + "b",
        ]


HUGE_INTS = [0, -1, 1, 2, -2**31, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -2**63, 2**64 - 1, 10**12]
HOSTILE_FLOATS = [0.0, -0.0, -1.0, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan, 2.0**63, 0.5]
NAMES = ["node-0", "run", "ckpt_000001", "0:0", "tcp://127.0.0.1:1", "tcp://[::1]:0", "inproc://x", "ipc:///tmp/x",
         "tcp://*:0", "tcp://0.0.0.0:99999", "CPU", "GPU", "memory", "barrier", "broadcast", "allgather", "sha256",
         "xxh3_128"]
LONG_STRINGS = ["x" * n for n in (LONG, 4096, 256)]  # made once: a case sends them, it need not build them
CHARS = [chr(c) for c in (0, 10, 47, 46, 65, 97, 0x7f, 0xe9, 0x2603, 0x1f600)]  # NUL, newline, "/", ".", ...
ZEROS = [b"\0" * n for n in (LONG, 1 << 20)]
FEW = 8  # a list or dict of many items: this many generated, the others copies of them (see `_many`)


@functools.lru_cache(maxsize=None)
def type_info(cls: type) -> mi.Type:
    """msgspec's description of `cls`, once per class: building it costs more than a case."""
    return mi.type_info(cls)


class Hostile:
    def __init__(self, rng: random.Random, targets: Targets, wrong: float = 0.04, json: bool = False,
                 long_strings: list[str] = LONG_STRINGS, zeros: list[bytes] = ZEROS) -> None:
        """`wrong`: how often a field gets a value of another type. `json`: for a JSON document, where a
        NaN or an infinity is written as null (a wrong type of its own). `long_strings`, `zeros`: the long
        strings and bytes a field may get."""
        self.rng = rng
        self._long, self._zeros = long_strings, zeros
        self.wrong = wrong
        self._floats = [f for f in HOSTILE_FLOATS if math.isfinite(f)] if json else HOSTILE_FLOATS
        self.targets = targets
        self._paths = targets.paths()

    def _pick(self, items: list) -> Any:
        """`rng.choice`, at a fraction of its cost: the generator's every value goes through it."""
        return items[int(self.rng.random() * len(items))]

    # ---- scalars ------------------------------------------------------------------------------

    def string(self) -> str:
        r = self.rng.random()
        if r < 0.45:
            return self._pick(self._paths)
        if r < 0.55:
            return self._pick(self._long)
        if r < 0.65:
            return self._pick(NAMES)
        return "".join(self.rng.choices(CHARS, k=int(self.rng.random() * 13)))

    def integer(self) -> int:
        return self._pick(HUGE_INTS) if self.rng.random() < 0.7 else int(self.rng.random() * 2001) - 1000

    def floating(self) -> float:
        return self._pick(self._floats) if self.rng.random() < 0.7 else self.rng.uniform(-1e6, 1e6)

    def raw(self) -> bytes:
        r = self.rng.random()
        if r < 0.3:
            return b""
        if r < 0.4:
            return self._pick(self._zeros)
        return self.rng.randbytes(self._pick([1, 7, 16, 32, 33, 255]))

    def count(self) -> int:
        """How many items a list or dict gets: mostly few, now and then many."""
        r = self.rng.random()
        return 0 if r < 0.3 else 1 + int(self.rng.random() * 3) if r < 0.9 else self._pick([50, 1000])

    def anything(self, depth: int = 0) -> Any:
        """A value of no declared type: what a field of the wrong type receives."""
        kind = int(self.rng.random() * (8 if depth < 2 else 6))
        if kind == 0:
            return self.string()
        if kind == 1:
            return self.integer()
        if kind == 2:
            return self.floating()
        if kind == 3:
            return self.raw()
        if kind == 4:
            return None
        if kind == 5:
            return True
        if kind == 6:
            return [self.anything(depth + 1) for _ in range(int(self.rng.random() * 4))]
        return {self.string(): self.anything(depth + 1) for _ in range(int(self.rng.random() * 4))}

    # ---- declared types -----------------------------------------------------------------------

    def of(self, t: mi.Type, depth: int = 0) -> Any:
        if self.rng.random() < self.wrong:
            return self.anything(depth)  # the wrong type
        kind = type(t)
        if kind is mi.StrType:
            return self.string()
        if kind is mi.IntType:
            return self.integer()
        if kind is mi.FloatType:
            return self.floating()
        if kind is mi.BoolType:
            return self.rng.random() < 0.5
        if kind is mi.BytesType:
            return self.raw()
        if kind is mi.NoneType:
            return None
        if kind is mi.AnyType:
            return self.anything(depth)
        if kind is mi.UnionType:
            return self.of(self._pick(t.types), depth)
        if kind is mi.LiteralType:
            return self._pick(t.values)
        if kind in (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType):
            # Many items at the top only: a thousand lists of a thousand is a size no test can afford.
            n = self.count() if depth < 2 else min(self.count(), 3) if depth < 3 else 0
            return self._many(n, lambda: self.of(t.item_type, depth + 1))
        if kind is mi.TupleType:
            return [self.of(x, depth + 1) for x in t.item_types]
        if kind is mi.DictType:
            n = self.count() if depth < 2 else min(self.count(), 3) if depth < 3 else 0
            values = self._many(n, lambda: self.of(t.value_type, depth + 1))
            return {self.key(t.key_type): v for v in values}
        if kind is mi.StructType:
            return self.struct(t, depth + 1)
        return self.anything(depth)

    def _many(self, n: int, make) -> list:
        """`n` items: `FEW` of them generated, the others copies of those. A list of a thousand is there to
        be long (what a reader does with its size); what each item holds, a case's few and the other cases
        vary, and generating a thousand structs each would cost more than the reading under test."""
        items = [make() for _ in range(min(n, FEW))]
        if n > FEW:
            items += [items[int(self.rng.random() * FEW)] for _ in range(n - FEW)]
        return items

    def key(self, t: mi.Type) -> Any:
        return self.integer() if type(t) is mi.IntType else self.string()

    def struct(self, t: mi.StructType, depth: int = 0) -> Any:
        out: dict[str, Any] = {}
        if t.tag_field is not None:
            out[t.tag_field] = t.tag
        for f in t.fields:
            if not f.required and self.rng.random() < 0.3:
                continue
            if f.required and self.rng.random() < self.wrong / 4:
                continue  # a required field missing
            out[f.encode_name] = self.of(f.type, depth)
        if self.rng.random() < self.wrong / 2:
            out["unknown_field"] = self.anything(depth)
        if t.array_like:
            return list(out.values())
        return out

    def message(self, cls: type) -> dict[str, Any]:
        """One message of `cls` (a tagged wire struct) as a dict, hostile in its fields."""
        return self.struct(type_info(cls))

    # ---- frames -------------------------------------------------------------------------------

    def frame(self, classes: list[type]) -> bytes:
        """One frame for a socket that decodes `classes`: mostly a message of one of them with hostile fields;
        else random bytes, another header, a message cut short, or one of a type the socket does not take."""
        r = self.rng.random()
        body = msgspec.msgpack.encode(self.message(self.rng.choice(classes)))
        if r < 0.70:
            return HEADER + body
        if r < 0.78:
            return HEADER + body[:self.rng.randint(0, max(0, len(body) - 1))]  # truncated
        if r < 0.83:
            return MAGIC + bytes([self.rng.choice([0, 1, 2, 4, 255])]) + body  # another protocol version
        if r < 0.88:
            return self.rng.choice([b"", MAGIC, HEADER, b"OL", body])  # no header, or only one
        if r < 0.93:
            other = self.rng.choice(WIRE_TYPES)
            return HEADER + msgspec.msgpack.encode(self.message(other))  # a message of another door
        return HEADER + self.rng.randbytes(self.rng.randint(0, 64))

    def multipart(self, classes: list[type]) -> list[bytes]:
        """What a DEALER sends a ROUTER: usually one frame, sometimes none, or several (the wrong count)."""
        r = self.rng.random()
        if r < 0.85:
            return [self.frame(classes)]
        if r < 0.9:
            return [b""]
        return [self.frame(classes) for _ in range(self.rng.randint(2, 4))]


def _wire_types() -> list[type]:
    """Every wire message, but the three that stop or drain a node or its fork server: their senders (a key
    holder, the agent) may, and the fuzzer must not."""
    return [v for v in vars(m).values() if isinstance(v, type) and issubclass(v, m.Msg)
            and v not in (m.Msg, m.Shutdown, m.DrainNode, m.StopForking)]


WIRE_TYPES = _wire_types()


def classes_of(union: Any) -> list[type]:
    """The message classes of a union such as `m.AgentRequest`."""
    return list(getattr(union, "__args__", (union,)))
