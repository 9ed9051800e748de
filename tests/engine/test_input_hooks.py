"""The order in which a tensor's hooks run when it is one module's output and another's input:
the consumer's input hook first, whether it joined the producer's ``OutputHook`` or was
prepended to the tensor's hooks (backward_done.py)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from fsdp2.engine.backward_done import InputHooks, OutputHook, hook_output


@pytest.mark.parametrize("user_hook_first", [False, True])
@pytest.mark.parametrize("consumers", [1, 2])
def test_input_hooks_run_first(user_hook_first: bool, consumers: int) -> None:
    ran: list[str] = []
    x = torch.randn(3, requires_grad=True)
    t = x * 2  # the producer's output
    if user_hook_first:  # registered inside the producer's forward, before its post-forward
        t.register_hook(lambda g: ran.append("user"))
    hook_output(t, lambda g: ran.append("producer"))
    if not user_hook_first:
        t.register_hook(lambda g: ran.append("user"))
    joined = OutputHook.first_on(t) is not None
    assert joined is not user_hook_first  # joining only where the producer's hook is first
    hooks = []
    for i in range(consumers):
        h = InputHooks(on_done=lambda i=i: ran.append(f"consumer {i} done"))
        h.hook(((t,), {}), round_key=(0, 0))
        hooks.append(h)
    (t * 3).sum().backward(retain_graph=True)
    # Each consumer's hook goes before every hook already there: the newest runs first.
    consumers_first = [f"consumer {i} done" for i in reversed(range(consumers))]
    rest = ["user", "producer"] if user_hook_first else ["producer", "user"]
    assert ran == consumers_first + rest

    # Dropped records leave the producer's hooks as they were, and fire nothing.
    for h in hooks:
        h.clear()
    ran.clear()
    (t * 3).sum().backward()
    assert ran == rest
    if joined:
        hook = OutputHook.first_on(t)
        assert hook is not None and hook.before == []


def test_saving_a_hooked_output_saves_no_hook() -> None:
    """The hook lives in the tensor's hooks, not in its attributes, which torch.save pickles:
    saving a model's output (a loss, logits) must not try to pickle the module state."""
    x = torch.randn(3, requires_grad=True)
    t = x * 2
    hook_output(t, lambda g: None)  # a lambda: pickling it would raise
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor warn that the hook is not saved: it is fsdp2's
        torch.save(t, io.BytesIO())
