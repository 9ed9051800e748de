"""The engine's state machine refuses an illegal transition, naming both states.

A group's sharded state changes only in ``FSDPParamGroup._enter``, which checks the state it
leaves. No user action reaches the error (the whole suite runs through the legal edges), so the
test drives it directly. (A module's ``TrainingState`` is no checked machine: every pair of its
states is a real edge; see its docstring.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.harness import run_on_ranks

pytestmark = pytest.mark.usefixtures("fsdp2_only")


def _illegal_transitions() -> list[str]:
    from fsdp2 import fully_shard
    from fsdp2.engine.param_group import ShardedState
    from fsdp2.engine.state import state_of

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()  # a legal round first: lazy init, every edge
    state = state_of(model[0])
    assert state is not None
    group = state.groups[0]
    seen = []
    with pytest.raises(AssertionError) as err:
        group._enter(ShardedState.K_SHARDED)  # only an unsharded group reshards to k ranks
    seen.append(str(err.value))
    return seen


def test_illegal_transitions_raise() -> None:
    (group_msg,) = run_on_ranks(1, _illegal_transitions)[0]
    assert "illegal transition SHARDED -> K_SHARDED" in group_msg
    assert "expected to leave one of UNSHARDED" in group_msg
