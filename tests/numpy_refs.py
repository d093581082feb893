"""NumPy references used by more than one test file (float64, paths unlike the JAX code)."""

import numpy as np


def np_rotate(x, positions, inv_freq, layout):
    """RoPE as complex multiplication: pair (a, b) -> (a + ib) * e^{i p f}."""
    x = np.asarray(x, np.float64)
    r = x.shape[-1]
    if layout == "interleaved":
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : r // 2] + 1j * x[..., r // 2:]
    ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    z = z * np.exp(1j * ang)
    out = np.empty_like(x)
    if layout == "interleaved":
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : r // 2], out[..., r // 2:] = z.real, z.imag
    return out
