"""The building blocks a policy network is made of, by name: feed-forward blocks map features to
features; recurrent blocks also carry a state (zeros at an episode's start).

Each builder takes the block's spec (from policy.json) and what flows in, and returns the module and
what flows out. A block's spec is checked here, once, at load time.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn

from .errors import PolicyLoadError

ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "tanh": mx.tanh, "relu": nn.relu, "gelu": nn.gelu, "silu": nn.silu, "elu": nn.elu,
    "identity": lambda x: x,
}


def _ints(spec: Mapping[str, Any], key: str, default: list[int] | None = None) -> list[int]:
    value = spec.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                              for v in value):
        raise PolicyLoadError(f"block {spec.get('type')!r}: '{key}' must be a list of positive integers")
    return value


def _activation(spec: Mapping[str, Any], default: str) -> Callable[[mx.array], mx.array]:
    name = spec.get("activation", default)
    if name not in ACTIVATIONS:
        raise PolicyLoadError(f"block {spec.get('type')!r}: activation {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _size(spec: Mapping[str, Any], key: str) -> int:
    value = spec.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PolicyLoadError(f"block {spec.get('type')!r}: '{key}' must be a positive integer")
    return value


class MLP(nn.Module):
    """Linear layers, each followed by the activation: features [B, n] -> [B, sizes[-1]]."""

    def __init__(self, in_features: int, sizes: list[int], activation: Callable[[mx.array], mx.array]) -> None:
        super().__init__()
        dims = [in_features, *sizes]
        self.layers = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
        self._act = activation

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = self._act(layer(x))
        return x


class ConvEncoder(nn.Module):
    """2-D convolutions (no padding) over images [B, H, W, C], flattened: -> [B, features]."""

    def __init__(self, in_shape: tuple[int, ...], channels: list[int], kernels: list[int], strides: list[int],
                 activation: Callable[[mx.array], mx.array]) -> None:
        super().__init__()
        h, w, c = in_shape
        self.convs = []
        for out, k, s in zip(channels, kernels, strides):
            self.convs.append(nn.Conv2d(c, out, k, stride=s))
            h, w, c = (h - k) // s + 1, (w - k) // s + 1, out
            if h <= 0 or w <= 0:
                raise PolicyLoadError(f"conv block: the image {list(in_shape)} is too small for its kernels")
        self.out_features = h * w * c
        self._act = activation

    def __call__(self, x: mx.array) -> mx.array:
        for conv in self.convs:
            x = self._act(conv(x))
        return x.reshape(x.shape[0], -1)


class LSTMCore(nn.Module):
    """One LSTM step: x [B, n], state {h, c} [B, hidden] -> (h, new state)."""

    def __init__(self, in_features: int, hidden: int, prefix: str) -> None:
        super().__init__()
        self.cell = nn.LSTM(in_features, hidden)
        self.state_names = (f"{prefix}h", f"{prefix}c")
        self.hidden = hidden

    def __call__(self, x: mx.array, state: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        h_name, c_name = self.state_names
        hs, cs = self.cell(x[:, None, :], state[h_name], state[c_name])
        return hs[:, -1], {h_name: hs[:, -1], c_name: cs[:, -1]}


class GRUCore(nn.Module):
    """One GRU step: x [B, n], state {h} [B, hidden] -> (h, new state)."""

    def __init__(self, in_features: int, hidden: int, prefix: str) -> None:
        super().__init__()
        self.cell = nn.GRU(in_features, hidden)
        self.state_names = (f"{prefix}h",)
        self.hidden = hidden

    def __call__(self, x: mx.array, state: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        (h_name,) = self.state_names
        hs = self.cell(x[:, None, :], state[h_name])
        return hs[:, -1], {h_name: hs[:, -1]}


def _mlp(spec: Mapping[str, Any], in_features: int) -> tuple[nn.Module, int]:
    sizes = _ints(spec, "sizes")
    return MLP(in_features, sizes, _activation(spec, "tanh")), sizes[-1]


def _recurrent(kind: type[LSTMCore] | type[GRUCore]) -> Callable[[Mapping[str, Any], int], tuple[nn.Module, int]]:
    def build(spec: Mapping[str, Any], in_features: int) -> tuple[nn.Module, int]:
        prefix = spec.get("name", "")
        if not isinstance(prefix, str):
            raise PolicyLoadError(f"block {spec.get('type')!r}: 'name' must be a string")
        hidden = _size(spec, "hidden")
        return kind(in_features, hidden, f"{prefix}_" if prefix else ""), hidden
    return build


FEATURE_BLOCKS: dict[str, Callable[[Mapping[str, Any], int], tuple[nn.Module, int]]] = {
    "mlp": _mlp, "lstm": _recurrent(LSTMCore), "gru": _recurrent(GRUCore),
}
"""Blocks over flat features [B, n], by their policy.json `type`; `conv` encodes an image input first."""


def conv_encoder(spec: Mapping[str, Any], in_shape: tuple[int, ...]) -> ConvEncoder:
    if len(in_shape) != 3:
        raise PolicyLoadError("conv block: its input must be an image [null, H, W, C]")
    channels = _ints(spec, "channels")
    kernels = _ints(spec, "kernels", [3] * len(channels))
    strides = _ints(spec, "strides", [1] * len(channels))
    if not len(channels) == len(kernels) == len(strides):
        raise PolicyLoadError("conv block: channels, kernels and strides must have the same length")
    return ConvEncoder(in_shape, channels, kernels, strides, _activation(spec, "relu"))
