"""The all-gather extension protocol: a tensor subclass decides what its shard sends.

A sharded local tensor whose class defines ``fsdp_pre_all_gather(mesh, outer_size, outer_stride,
module, mp_policy) -> (inputs, metadata)`` and ``fsdp_post_all_gather(outputs, metadata,
param_dtype, *, out=None)`` is gathered as the ``inputs`` it returns (e.g. int8 data and scales
instead of fp32), and its unsharded parameter is whatever the post hook builds from the gathered
``outputs`` (each input concatenated over ranks along dim 0). The first post hook returns
``(tensor, inner_tensors)``; later ones refill that tensor in place (``out=``) after fsdp2
re-allocates the inner tensors it freed at reshard.

The older one-argument form, ``fsdp_pre_all_gather(mesh)`` (torchao's float8 training weights and
its NF4 tensors define it), is still honoured: the hook's signature decides which form is called.

How a group gathers such parameters (bytes, packed with its plain shard) is packing.py.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2.engine.policies import MixedPrecisionPolicy

    class Extension(Protocol):
        """What ``has_extension`` checks a shard for: the two hooks of the module docstring."""

        def fsdp_pre_all_gather(
            self,
            mesh: DeviceMesh,
            outer_size: torch.Size,
            outer_stride: tuple[int, ...],
            module: nn.Module,
            mp_policy: MixedPrecisionPolicy,
        ) -> tuple[Sequence[torch.Tensor], Any]: ...

        @overload
        def fsdp_post_all_gather(
            self,
            all_gather_outputs: tuple[torch.Tensor, ...],
            metadata: Any,
            param_dtype: torch.dtype,
        ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]: ...

        @overload
        def fsdp_post_all_gather(
            self,
            all_gather_outputs: tuple[torch.Tensor, ...],
            metadata: Any,
            param_dtype: torch.dtype,
            *,
            out: torch.Tensor,
        ) -> None: ...


__all__ = [
    "ExtensionState",
    "contiguous_strides",
    "has_extension",
    "mesh_only",
    "releases_outputs",
]

# An extension declares with this method (torch 2.15's name) that its post hook's parameter
# does not alias the gathered inputs, which may then be freed at once.
_RELEASE = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


@dataclass
class ExtensionState:
    """What gathering keeps of one extension parameter from one gather to the next; written by
    ``packing.py`` alone."""

    mesh: DeviceMesh | None = None  # handed to the pre hook (packing.shard_mesh)
    # The gathered inputs handed to the post hook, kept across gathers: a hook may keep them as
    # the unsharded parameter's inner tensors and refill nothing itself (out=).
    outputs: list[torch.Tensor] | None = None
    # The unsharded parameter's inner tensors with their sizes, once the post hook built them.
    inner: list[tuple[torch.Tensor, int]] | None = None
    # The post hook's result does not alias ``outputs`` (releases_outputs): free them as soon
    # as it ran, not at reshard; the next gather regrows them.
    release_outputs: bool = False


def releases_outputs(tensor: torch.Tensor) -> bool:
    """What ``tensor``'s class answers to ``fsdp_should_release_all_gather_outputs_after_
    post_all_gather()`` (``False`` without the method); asked once, at ``fully_shard``. Raises
    if it answers anything but a bool, or comes without the two gather hooks."""
    method = getattr(tensor, _RELEASE, None)
    if method is None:
        return False
    if not has_extension(tensor):
        raise TypeError(
            f"{type(tensor).__name__} defines {_RELEASE} but not fsdp_pre_all_gather and "
            "fsdp_post_all_gather; it only means something for an all-gather extension"
        )
    answer = method()
    if not isinstance(answer, bool):
        raise TypeError(
            f"{type(tensor).__name__}.{_RELEASE}() must return a bool, got {type(answer).__name__}"
        )
    return answer


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` defines the extension's hooks; raises if one is missing, or if the pre
    hook takes neither form (at ``fully_shard``, from its class: alike on every rank)."""
    pre = hasattr(tensor, "fsdp_pre_all_gather")
    if pre != hasattr(tensor, "fsdp_post_all_gather"):
        raise TypeError(
            f"{type(tensor).__name__} defines only one of fsdp_pre_all_gather and "
            "fsdp_post_all_gather; the all-gather extension needs both"
        )
    if pre:
        mesh_only(cast("Extension", tensor))
    return pre


# Per hook function: whether it is the one-argument form. Weak keys: a class may be redefined.
_MESH_ONLY: weakref.WeakKeyDictionary[Callable[..., Any], bool] = weakref.WeakKeyDictionary()


def mesh_only(local: Extension) -> bool:
    """Whether ``local``'s pre hook is the older ``fsdp_pre_all_gather(mesh)``; decided by its
    number of parameters (``self`` not counted), once per hook function."""
    hook = local.fsdp_pre_all_gather
    func = getattr(hook, "__func__", hook)
    known = _MESH_ONLY.get(func)
    if known is not None:
        return known
    signature = inspect.signature(hook)
    if len(signature.parameters) not in (1, 5):
        names = ", ".join(signature.parameters)
        raise TypeError(
            f"{type(local).__name__}.fsdp_pre_all_gather({names}) takes "
            f"{len(signature.parameters)} arguments after self; the all-gather extension calls "
            "it as fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy), or "
            "in its older form fsdp_pre_all_gather(mesh). Define one of the two"
        )
    one_arg = len(signature.parameters) == 1
    try:
        _MESH_ONLY[func] = one_arg
    except TypeError:  # not weakly referenceable (a builtin): decided again at the next gather
        pass
    return one_arg


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``torch.empty(shape).stride()`` gives)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
