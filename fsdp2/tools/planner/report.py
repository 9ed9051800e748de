"""``Plan``: the planner's answer for one world size, as numbers, JSON and a table."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp2.tools.planner.estimate import Collective
from fsdp2.tools.planner.groups import GroupFacts

__all__ = ["Comparison", "Plan"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def wire_bytes(c: Collective) -> int:
    """Bytes this rank receives (and sends) under the ring algorithm: (W-1)/W of the full
    buffer for an all-gather or reduce-scatter, twice that for an all-reduce."""
    full = max(c.input_nbytes, c.output_nbytes)
    share = full * (c.world_size - 1) // c.world_size
    return 2 * share if c.kind == "all_reduce" else share


@dataclass
class Plan:
    """Per-rank memory and communication of one training step (bytes; rank 0, which holds
    the most real rows). ``held_bytes`` is what stays allocated between steps; the transient
    and activation figures come on top during forward/backward."""

    world_size: tuple[int, ...]  # (shard,) for FSDP, (replicate, shard) for HSDP
    num_params: int
    optimizer: str
    param_bytes: int  # the flat shard buffers, padding included
    param_padding_bytes: int  # the most any rank holds (the last ranks: fewest real rows)
    grad_bytes: int  # reduced gradient shards (held until zero_grad): what .grad holds
    grad_padding_bytes: int
    grad_flag_bytes: int  # the reduce-scatters' "used" flags, held in the gradients' buffers
    optim_bytes: int
    buffer_bytes: int  # module buffers, whole on every rank
    kept_gathered_bytes: int  # memory modes: parameters kept gathered between steps (zero2, hfsdp)
    forward_transient_bytes: int
    forward_transient_at: str
    backward_transient_bytes: int
    backward_transient_at: str
    backward_start_bytes: int  # the transient as backward begins, when activations peak
    activation_bytes: int | None  # None: no example batch given
    collectives: list[Collective]
    groups: list[GroupFacts]
    notes: list[str] = field(default_factory=list)
    # The coalescing budget planned with (0: off). The collectives are those of a steady-state
    # step: every step after the first (which cannot coalesce its forward gathers).
    coalesce_bytes: int = 0
    step: str = "steady state (every step after the first)"
    _replan: Callable[[int | Sequence[int]], Plan] | None = field(default=None, repr=False)

    @property
    def held_bytes(self) -> int:
        grads = self.grad_bytes + self.grad_flag_bytes
        kept = self.kept_gathered_bytes
        return self.param_bytes + grads + self.optim_bytes + self.buffer_bytes + kept

    @property
    def transient_bytes(self) -> int:
        return max(self.forward_transient_bytes, self.backward_transient_bytes)

    @property
    def peak_bytes(self) -> int:
        """The step's peak: activations are largest as backward begins, before gradients
        exist (those of the previous step were dropped by ``zero_grad``), beside the groups
        gathered then; later, gradients grow as activations are freed, so the FSDP transient's
        own peak is taken with every gradient held (an upper bound for that phase)."""
        start = self.held_bytes - self.grad_bytes - self.grad_flag_bytes + self.backward_start_bytes
        return max(start + (self.activation_bytes or 0), self.held_bytes + self.transient_bytes)

    def counts(self) -> dict[str, int]:
        return {k: sum(c.kind == k for c in self.collectives) for k in KINDS}

    def payload_bytes(self) -> dict[str, int]:
        """Per kind, the bytes of the full buffers (all-gather output, reduce-scatter input)."""
        return {
            k: sum(max(c.input_nbytes, c.output_nbytes) for c in self.collectives if c.kind == k)
            for k in KINDS
        }

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends (and as many it receives) per step, ring algorithms."""
        return sum(wire_bytes(c) for c in self.collectives)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name[0] != "_"}
        out["collectives"] = [dataclasses.asdict(c) for c in self.collectives]
        out["groups"] = [dataclasses.asdict(g) for g in self.groups]
        out["world_size"] = list(self.world_size)
        for name in ("held_bytes", "transient_bytes", "peak_bytes", "wire_bytes"):
            out[name] = getattr(self, name)
        out["collective_counts"] = self.counts()
        out["collective_payload_bytes"] = self.payload_bytes()
        return out

    def compare(self, world_sizes: Sequence[int | Sequence[int]]) -> Comparison:
        """The same model, sharding and options planned at each of ``world_sizes``."""
        if self._replan is None:
            raise RuntimeError("this Plan was not made by fsdp2.plan(); it cannot re-plan")
        return Comparison([self._replan(w) for w in world_sizes])

    def summary_rows(self) -> list[tuple[str, str]]:
        counts, payload = self.counts(), self.payload_bytes()
        act = "-" if self.activation_bytes is None else _mib(self.activation_bytes)
        rows = [
            (
                "parameters (sharded)",
                f"{_mib(self.param_bytes)}  (padding {_mib(self.param_padding_bytes)})",
            ),
            ("gradients", f"{_mib(self.grad_bytes)}  (padding {_mib(self.grad_padding_bytes)})"),
            ("gradient flags (one per parameter)", _mib(self.grad_flag_bytes)),
            (f"optimizer state ({self.optimizer})", _mib(self.optim_bytes)),
            ("buffers", _mib(self.buffer_bytes)),
            *(
                [("parameters kept gathered (zero2, hfsdp)", _mib(self.kept_gathered_bytes))]
                if self.kept_gathered_bytes
                else []
            ),
            ("held between steps", _mib(self.held_bytes)),
            (
                "FSDP transient, forward",
                f"{_mib(self.forward_transient_bytes)}  at {self.forward_transient_at}",
            ),
            (
                "FSDP transient, backward",
                f"{_mib(self.backward_transient_bytes)}  at {self.backward_transient_at}",
            ),
            ("activations (fake-tensor run)", act),
            ("peak", _mib(self.peak_bytes)),
        ]
        if self.coalesce_bytes:
            rows.append(("coalescing budget", _mib(self.coalesce_bytes)))
        for kind in KINDS:
            if counts[kind]:
                merged = sum(c.kind == kind and "+" in c.label for c in self.collectives)
                also = f" ({merged} coalesced)" if merged else ""
                rows.append(
                    (f"{kind} per step", f"{counts[kind]} x{also}, {_mib(payload[kind])} payload")
                )
        rows.append(("sent (= received) per rank per step", _mib(self.wire_bytes)))
        return rows

    def __str__(self) -> str:
        title = f"fsdp2.plan: world {'x'.join(map(str, self.world_size))}, {self.num_params:,} parameters, per rank"
        groups = [
            (
                g.label or "<root>",
                f"{g.num_params:,}",
                _mib(g.unsharded_bytes),
                _mib(g.sharded_bytes),
                "yes" if g.reshard_after_forward else "no",
            )
            for g in self.groups
        ]
        head = ("group", "params", "unsharded", "shard", "reshard after fwd")
        return _render(title, self.summary_rows(), head, groups, self.notes)


@dataclass
class Comparison:
    """Plans of one model at several world sizes, side by side."""

    plans: list[Plan]

    def to_dict(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.plans]

    def __str__(self) -> str:
        head = (
            "world",
            "params",
            "grads",
            "optim",
            "held",
            "transient",
            "peak",
            "AG",
            "RS",
            "AR",
            "sent",
        )
        rows = []
        for p in self.plans:
            c = p.counts()
            rows.append(
                (
                    "x".join(map(str, p.world_size)),
                    _mib(p.param_bytes),
                    _mib(p.grad_bytes),
                    _mib(p.optim_bytes),
                    _mib(p.held_bytes),
                    _mib(p.transient_bytes),
                    _mib(p.peak_bytes),
                    str(c["all_gather"]),
                    str(c["reduce_scatter"]),
                    str(c["all_reduce"]),
                    _mib(p.wire_bytes),
                )
            )
        notes = self.plans[0].notes if self.plans else []
        return _render("fsdp2.plan: per rank as the world grows", [], head, rows, notes)


def _mib(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (3 significant-ish
    digits): what a reader compares against a device's memory."""
    value, unit = float(nbytes), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{nbytes} B" if unit == "B" else f"{value:,.2f} {unit}"


def _render(
    title: str,
    pairs: list[tuple[str, str]],
    head: tuple[str, ...],
    rows: Sequence[tuple[str, ...]],
    notes: list[str],
) -> str:
    """A rich table where rich is installed, aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return _plain(title, pairs, head, rows, notes)
    console = Console(width=140, record=True, file=io.StringIO())
    if pairs:
        summary = Table(title=title, show_header=False)
        summary.add_column(style="bold")
        summary.add_column(justify="right")
        for pair in pairs:
            summary.add_row(*pair)
        console.print(summary)
    table = Table(title=None if pairs else title)
    for i, name in enumerate(head):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for note in notes:
        console.print(f"note: {note}", highlight=False)
    text: str = console.export_text()
    return text.rstrip()


def _plain(
    title: str,
    pairs: list[tuple[str, str]],
    head: tuple[str, ...],
    rows: Sequence[tuple[str, ...]],
    notes: list[str],
) -> str:
    lines = [title]
    width = max((len(k) for k, _ in pairs), default=0)
    lines += [f"  {k:<{width}}  {v}" for k, v in pairs]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    for row in (head, *rows):
        lines.append(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
