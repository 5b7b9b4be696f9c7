"""How captured features are stored in a shard (`capture.feature_dtype`), and read back.

raw (`capture.feature_dtype: bf16`): as the target computed them (a bf16 target's features as
their uint16 bit pattern; the float32 CPU test targets' natively). 2 bytes per value.

fp8 (`capture.feature_dtype: fp8`, encoding FP8): each token's k layer vectors of H values are
scaled by a power of two chosen per (token, layer), s = 2^e with e the least exponent that brings
the vector's largest magnitude to at most 448 (float8_e4m3fn's largest value), and rounded to
e4m3fn. Stored as uint8 [T, k*(H+1)]: per (token, layer) the exponent e as one int8 byte, then
the H e4m3 bytes. Decoded to the target's dtype.

Why this scheme: hidden states' magnitudes differ by orders of magnitude between layers (they
grow with depth) and between tokens (a few "massive activation" tokens), so one scale per tensor
would push most rows into e4m3's subnormals; a scale per (token, layer) follows both. The scale is
a power of two (like the E8M0 scales of OCP's MX formats) instead of an fp32 number: it costs one
byte instead of four (an fp32 scale adds 4/H of the payload: 6% at H=64, and the shard is then
no longer half of bf16's), multiplying by it is exact, and the decoded value, at most 4
significant bits times a power of two, is exact in bf16 and fp32. The only error is e4m3's
rounding to nearest: per value |x - decoded| <= max(|x| / 16, s / 1024) (normal range: half an
ulp of 3 mantissa bits, 2^-4 relative; below e4m3's smallest normal 2^-6 * s: half the subnormal
step 2^-9 * s). The largest value of each (token, layer) lands in (224, 448], e4m3's top binade.
Bytes per token: k*(H+1) against bf16's 2*k*H, i.e. 0.5 + 1/(2H) of bf16 for the features.
"""

from __future__ import annotations

import numpy as np
import torch

RAW = "raw"
FP8 = "fp8_e4m3_pow2"
FEATURE_ENCODINGS = (RAW, FP8)
ENCODING_OF = {"bf16": RAW, "fp8": FP8}  # capture.feature_dtype -> Provenance.feature_encoding
E4M3_MAX = 448.0
_E_MIN, _E_MAX = -126, 126  # 2^e and 2^-e both normal float32 numbers


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as float32, built from the exponent bits (exact; e in [_E_MIN, _E_MAX])."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def encode_fp8(features: torch.Tensor, layers: int) -> np.ndarray:
    """features [T, k*H] (finite, any float dtype) -> uint8 [T, k*(H+1)] (module docstring)."""
    t, width = features.shape
    if width % layers:
        raise ValueError(f"features width {width} is not a multiple of the {layers} captured layers")
    x = features.detach().cpu().to(torch.float32).reshape(t, layers, width // layers)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("fp8 features need finite values (capture skips rows holding NaN/Inf before writing)")
    amax = x.abs().amax(-1)  # [T, k]
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(_E_MIN, _E_MAX)
    e = e + (amax * _pow2(-e) > E4M3_MAX)  # log2's rounding: the least e with amax / 2^e <= 448
    e = e.clamp(_E_MIN, _E_MAX).to(torch.int32)
    q = (x * _pow2(-e)[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty(t, layers, width // layers + 1, dtype=torch.uint8)
    out[..., 0] = e.to(torch.int8).view(torch.uint8)
    out[..., 1:] = q
    return out.reshape(t, -1).numpy()


def decode_fp8(stored: np.ndarray, shape: list[int], dtype: torch.dtype, layers: int) -> torch.Tensor:
    """uint8 [T, k*(H+1)] of `layers` = k -> features [T, k*H] (`shape`) in `dtype`; exact in
    bf16 and fp32."""
    t, width = shape
    if (stored.dtype != np.uint8 or stored.ndim != 2 or layers < 1 or width % layers
            or list(stored.shape) != [t, width + layers]):  # fmt: skip
        raise ValueError(f"fp8 features stored as {stored.dtype} {list(stored.shape)} cannot hold {shape}")
    packed = torch.from_numpy(np.ascontiguousarray(stored)).reshape(t, layers, width // layers + 1)
    e = packed[..., 0].contiguous().view(torch.int8).to(torch.int32)
    if bool(((e < _E_MIN) | (e > _E_MAX)).any()):
        raise ValueError(f"fp8 scale exponents outside [{_E_MIN}, {_E_MAX}]")
    q = packed[..., 1:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return (q * _pow2(e)[..., None]).reshape(t, width).to(dtype)


def fp8_error_bound(features: torch.Tensor, layers: int) -> torch.Tensor:
    """The per-value bound max(|x| / 16, s / 1024) of the module docstring, [T, k*H] float32."""
    t, width = features.shape
    x = features.detach().cpu().to(torch.float32).reshape(t, layers, width // layers)
    e = torch.from_numpy(encode_fp8(features, layers)).reshape(t, layers, -1)[..., 0].contiguous()
    s = _pow2(e.view(torch.int8).to(torch.int32))[..., None]
    return torch.maximum(x.abs() / 16, s / 1024).reshape(t, width)


def round_trip_fp8(features: torch.Tensor, layers: int) -> torch.Tensor:
    """decode_fp8(encode_fp8(features)) computed on the features' own device (the quality bench
    trains a variant on fp8-stored features without a trip through the host): the same exponent
    choice and e4m3fn rounding, the result in the input's dtype."""
    t, width = features.shape
    if width % layers:
        raise ValueError(f"features width {width} is not a multiple of the {layers} captured layers")
    x = features.to(torch.float32).reshape(t, layers, width // layers)
    amax = x.abs().amax(-1)
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(_E_MIN, _E_MAX)
    e = (e + (amax * _pow2(-e) > E4M3_MAX)).clamp(_E_MIN, _E_MAX)
    q = (x * _pow2(-e)[..., None]).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * _pow2(e)[..., None]).reshape(t, width).to(features.dtype)


def feature_bytes_per_token(encoding: str, dtype_bytes: int, layers: int, hidden: int) -> int:
    """Stored feature bytes per token: k*H values of the target's dtype (raw), or k*(H+1) (fp8)."""
    if encoding not in FEATURE_ENCODINGS:
        raise ValueError(f"unknown feature encoding {encoding!r} (known: {FEATURE_ENCODINGS})")
    return layers * (hidden + 1) if encoding == FP8 else layers * hidden * dtype_bytes
