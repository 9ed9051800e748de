"""`WrapperTensor`: the tensor subclass skeleton the all-gather extension tests build on.

Like torchao's float8 and NF4 weights, it holds its values in one inner tensor, ``_data``: every
op runs on ``_data`` and tensor results are wrapped back into the subclass. Subclasses add
FSDP's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks, or refuse ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


class WrapperTensor(torch.Tensor):
    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, dtype=data.dtype, device=data.device, strides=data.stride()
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any
    ) -> WrapperTensor:
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t._data if isinstance(t, cls) else t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)
