"""When a module's backward is done: the gradients of its forward inputs are in.

[Note: when a module's backward is done]
A group's trainable gradients being in ([Note: when a group's gradients are ready] in
reduce.py) does not mean autograd is done with its unsharded parameters:
- a frozen parameter saved for backward is still read to compute the gradient of the module's
  inputs (LoRA's ``base(x) + B(A(x))`` with ``base`` frozen: the adapters' gradients can all land
  before ``base``'s backward computes ``dx``; a frozen norm scaling a trainable layer's input);
- a reentrant checkpoint on a submodule recomputes that submodule's forward, with the registered
  parameters, after the gradients of the parameters outside it are in.
So a group reshards only once its module's backward is done as well: each forward call with grad
enabled hooks the tensors among its inputs that require grad, and the module is done in a graph
task once every call's hooks have fired in that task. A call whose inputs need no gradient gets no
hook: every node it leaves in the graph leads to one of its trainable parameters, whose
``AccumulateGrad`` runs after it, unless other sharded modules ran inside the call (the root
around its blocks): then its nodes also lead to their parameters, and the call is held until the
end of backward, as torch does for every call without input gradients. A call whose hooks
never fire (its inputs not needed by this backward) keeps the group gathered until the end of
backward: memory, never correctness.

The hook runs first among its tensor's hooks, before the pre-backward hook of the module that
produced the tensor, so that a block reshards before the block before it gathers. Where that
pre-backward hook is already the tensor's first (a block's input is the block before's output),
the input hook joins it (``OutputHook``) instead of adding a hook of its own: the same order, one
Python hook per tensor instead of two, nothing to re-order or remove.

A call's record holds its inputs' autograd nodes (to ask the engine which will run), and the
hooks find it by index, never by reference: node → hook → record → node would be a cycle through
C++ that the garbage collector cannot see, leaking the graph. Records are dropped at the module's
first forward after a backward (or in a new iteration), which removes their hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from fsdp2.engine.tree import tensors_in

__all__ = ["InputHooks", "OutputHook", "hook_output"]


def _will_run(node: Node) -> bool:
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        # A leaf whose gradient torch.autograd.grad() returns: its hook fires all the same.
        return True


class _Call:
    """One forward call's inputs that require grad, and how far their gradients got."""

    __slots__ = ("done_in", "left", "nodes", "task")

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes  # one per hooked tensor (tensors may share a node)
        self.task = -1  # the graph task ``left`` counts in
        self.left = 0  # hooks still to fire in that task
        self.done_in = -1  # the last graph task in which every expected hook fired


class InputHooks:
    """The forward calls of one ``fully_shard`` call's modules since its last backward, and
    whether their backward is done (see the note above)."""

    def __init__(self, on_done: Callable[[], None]) -> None:
        self.on_done = on_done  # a call's backward finished (maybe the last one)
        self._calls: list[_Call] = []
        self._handles: list[RemovableHandle] = []
        self._joined: list[tuple[OutputHook, Callable[[torch.Tensor], None]]] = []
        self._generation = 0  # bumped when records are dropped: older hooks do nothing
        self._round: object = None

    def hook(self, inputs: Any, round_key: object) -> list[torch.Tensor]:
        """At a forward call with grad enabled. ``round_key`` names the forward-backward round;
        records of an older round are dropped first. Returns the inputs that require grad."""
        if round_key != self._round:
            self._round = round_key
            self.clear()
        seen: set[int] = set()
        tensors = []
        for t in tensors_in(inputs):
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
        if not tensors:
            return tensors
        index = len(self._calls)
        # grad_fn is the gradient edge's node for any non-leaf (the usual input: an activation)
        self._calls.append(_Call([t.grad_fn or get_gradient_edge(t).node for t in tensors]))
        fn = partial(self._fired, self._generation, index)
        for t in tensors:
            joined = OutputHook.first_on(t)
            if joined is not None:
                joined.before.insert(0, fn)  # before every input hook already there, too
                self._joined.append((joined, fn))
            else:
                self._handles.append(_prepend_hook(t, fn))
        return tensors

    def hold(self) -> None:
        """Record a call that is never done before the end of backward."""
        self._calls.append(_Call([]))

    def clear(self) -> None:
        for handle in self._handles:
            handle.remove()
        for hook, fn in self._joined:
            hook.before.remove(fn)
        self._handles, self._joined, self._calls = [], [], []
        self._generation += 1

    def done(self) -> bool:
        """Whether every recorded call's backward is done in the running graph task."""
        task = torch._C._current_graph_task_id()
        for call in self._calls:  # a loop, not all(<generator>): asked twice per group and step
            if call.done_in != task:
                return False
        return True

    def _fired(self, generation: int, index: int, grad: torch.Tensor) -> None:
        if generation != self._generation:
            return  # a hook of dropped records (an older graph's backward)
        call = self._calls[index]
        task = torch._C._current_graph_task_id()
        if call.task != task:
            # Inputs this task computes no gradient for are not waited for. With one, this
            # hook firing says that it is computed.
            nodes = call.nodes
            call.task = task
            call.left = 1 if len(nodes) == 1 else sum(_will_run(n) for n in nodes)
        call.left -= 1
        if call.left <= 0 and call.done_in != task:
            call.done_in = task
            self.on_done()


class OutputHook:
    """A module's pre-backward hook on one of its output tensors (``hook_output``), which first
    runs the input hooks that joined it (``before``, newest first, as prepending puts them)."""

    __slots__ = ("before", "pre_backward")
    # torch.save of a hooked output (a loss, logits) skips the hook without a warning: it is
    # fsdp2's bookkeeping for this backward, not something the user put there to keep.
    __torch_unserializable__ = True

    def __init__(self, pre_backward: Callable[[torch.Tensor], None]) -> None:
        self.pre_backward = pre_backward
        self.before: list[Callable[[torch.Tensor], None]] = []

    def __call__(self, grad: torch.Tensor) -> None:
        for fn in tuple(self.before):  # a snapshot: a hook that runs may add one
            fn(grad)
        self.pre_backward(grad)

    @staticmethod
    def first_on(t: torch.Tensor) -> OutputHook | None:
        """The first of ``t``'s hooks (the engine runs them in the dict's order) if it is an
        ``OutputHook``, so that joining it is prepending; else ``None``. Found in the hooks
        themselves, not in an attribute on ``t``: ``torch.save`` and ``deepcopy`` copy a
        tensor's attributes, and would take the hook, and the module state behind it, along."""
        hooks = t._backward_hooks
        if not hooks:
            return None
        first = next(iter(hooks.values()))
        return first if type(first) is OutputHook else None


def hook_output(t: torch.Tensor, pre_backward: Callable[[torch.Tensor], None]) -> None:
    """``t.register_hook(pre_backward)``, as an ``OutputHook`` that input hooks can join."""
    t.register_hook(OutputHook(pre_backward))  # type: ignore[no-untyped-call]


def _prepend_hook(t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """``t.register_hook(fn)``, but run before the hooks already there. The engine walks the
    hooks dict in insertion order (``OrderedDict.move_to_end`` does not change it): re-insert
    the others after ``fn``."""
    handle: RemovableHandle = t.register_hook(fn)  # type: ignore[no-untyped-call]
    hooks = t._backward_hooks
    if hooks is not None and len(hooks) > 1:
        for key in [k for k in hooks if k != handle.id]:
            hooks[key] = hooks.pop(key)
    return handle
