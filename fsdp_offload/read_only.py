"""What `opt.state[p]` hands out: `ReadOnlyState`, a tensor that reads as the state it was gathered from
and refuses every write with an error saying how to change the state.

torch's AdamW hands out its live state tensors, so `opt.state[p]["exp_avg"].zero_()` changes the
next step. OffloadAdamW's state lives in subgroups out of core; what `opt.state[p]` gives is a copy
gathered from them, and a write to a copy would be lost silently. Each aten op whose schema writes
into a ReadOnlyState raises; views of one are ReadOnlyState too, so `.view(-1).add_()` or
`.detach().copy_()` raise as well. Everything else runs on the values and returns plain tensors.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


class ReadOnlyState(torch.Tensor):
    """A read-only copy of one state tensor (`key`) of an OffloadAdamW param."""

    @staticmethod
    def __new__(cls, values: torch.Tensor, key: str) -> ReadOnlyState:
        out = torch.Tensor._make_wrapper_subclass(cls, values.shape, strides=values.stride(), dtype=values.dtype,
                                                  device=values.device, storage_offset=values.storage_offset())  # fmt: skip
        out._values, out._key = values, key
        return out

    def __repr__(self) -> str:
        return f"ReadOnlyState({self._key}, {self._values!r})"

    def __reduce_ex__(self, protocol: int):
        return self._values.clone().__reduce_ex__(protocol)  # torch.save / pickle: the values, as a plain tensor

    def tolist(self):  # (not supported on wrapper subclasses)
        return self._values.tolist()

    def numpy(self, *, force: bool = False):
        values = self._values.numpy(force=force)
        values.flags.writeable = False  # a write would be lost as silently
        return values

    def __tensor_flatten__(self):
        return ["_values"], self._key

    @staticmethod
    def __tensor_unflatten__(inner: dict, key: str, outer_size, outer_stride) -> ReadOnlyState:
        return ReadOnlyState(inner["_values"], key)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        flat = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
        for arg, value in zip(schema.arguments, flat):
            if arg.alias_info is not None and arg.alias_info.is_write and _holds_read_only(value):
                key = next(t._key for t in _tensors(value) if isinstance(t, ReadOnlyState))
                raise RuntimeError(
                    f"{func.__name__} writes into opt.state[p][{key!r}]: OffloadAdamW's state lives out of core and "
                    "opt.state[p] gives a read-only copy of it. To change the state, edit opt.state_dict() and "
                    "load it back with opt.load_state_dict(state_dict)"
                )
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if schema.returns and schema.returns[0].alias_info is not None:  # a view: still read-only
            key = next(t._key for t in _tensors(list(args)) if isinstance(t, ReadOnlyState))
            return tree_map(lambda t: ReadOnlyState(t, key) if isinstance(t, torch.Tensor) else t, out)
        return out


def _unwrap(value):
    return value._values if isinstance(value, ReadOnlyState) else value


def _tensors(value) -> list:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _holds_read_only(value) -> bool:
    return any(isinstance(t, ReadOnlyState) for t in _tensors(value))
