"""Random QuantWeights of every format (planes with sane scales) and their float64 composition,
written from engine/quant/qweight.py's docstring (Q6_K from llama.cpp's dequantize_row_q6_K
loops), independently of the kernels. Shared by tests/kernels/test_qgemv.py and
tests/gpu/test_gpu_qgemv.py."""

from __future__ import annotations

import torch

from fgchat.engine.quant.qweight import QuantWeight

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "fp8", "int4")


def random_qweight(fmt: str, n: int, k: int, seed: int, device: str = "cpu",
                   dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
    """Weights of about 0.02 in size, as a trained model's, in `fmt`'s planes."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int, hi: int = 256) -> torch.Tensor:
        return torch.randint(0, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    def scale(*shape: int, size: float) -> torch.Tensor:
        return ((torch.rand(*shape, generator=g) + 0.5) * size).half()

    if fmt == "Q8_0":
        planes = {"d": scale(n, k // 32, size=0.02 / 64),
                  "qs": torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)}
    elif fmt == "Q4_0":
        planes = {"d": scale(n, k // 32, size=0.02 / 4), "qs": u8(n, k // 2)}
    elif fmt == "Q4_1":
        d = scale(n, k // 32, size=0.02 / 4)
        planes = {"d": d, "m": (-8 * d.float() * (torch.rand(n, k // 32, generator=g) + 0.5)).half(),
                  "qs": u8(n, k // 2)}
    elif fmt in ("Q4_K", "Q5_K"):
        planes = {"d": scale(n, k // 256, size=0.02 / 4 / 32), "dmin": scale(n, k // 256, size=0.02 / 32),
                  "sc": u8(n, k // 32, hi=64), "mn": u8(n, k // 32, hi=64), "qs": u8(n, k // 2)}
        if fmt == "Q5_K":
            planes["qh"] = u8(n, k // 8)
    elif fmt == "Q6_K":
        planes = {"d": scale(n, k // 256, size=0.02 / 32 / 64),
                  "sc": torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int32).to(torch.int8),
                  "ql": u8(n, k // 2), "qh": u8(n, k // 4)}
    elif fmt == "fp8":
        planes = {"w": (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                  "scale": (torch.rand(n, generator=g) + 0.5) * 0.02 / 64}
    elif fmt == "int4":
        planes = {"scale": scale(n, k // 128, size=0.02 / 4).to(torch.bfloat16), "qs": u8(n, k // 2)}
    else:
        raise ValueError(fmt)
    return QuantWeight(fmt, (n, k), {name: p.to(device) for name, p in planes.items()}, dtype)


def _nibbles(qs: torch.Tensor, pair: int) -> torch.Tensor:
    """[N, K] integer fields of a nibble plane: byte t's low nibble at k_lo = 2P*(t // P) + t % P,
    its high nibble at k_lo + P."""
    n, half = qs.shape
    t = torch.arange(half)
    k_lo = 2 * pair * (t // pair) + t % pair
    q = torch.empty(n, 2 * half, dtype=torch.float64)
    b = qs.cpu().to(torch.int64)
    q[:, k_lo] = (b & 15).double()
    q[:, k_lo + pair] = (b >> 4).double()
    return q


def compose(w: QuantWeight) -> torch.Tensor:
    """The weight's values [N, K] in float64 (exact)."""
    scaled, mins = _terms(w)
    return scaled + mins


def terms(w: QuantWeight) -> torch.Tensor:
    """Each weight's term magnitude [N, K] in float64: |s q| + |m| for a format with mins (w = s q
    + m: Q4_1, Q4_K, Q5_K), |w| for the others: what a product that carries s q and m separately
    rounds against."""
    scaled, mins = _terms(w)
    return scaled.abs() + mins.abs()


def _terms(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(s q, m) [N, K] in float64 with w = s q + m (m zero for formats without mins)."""
    n, k = w.shape
    p = {name: t.cpu() for name, t in w.planes.items()}
    zero = torch.zeros(n, k, dtype=torch.float64)

    def per(name: str, block: int) -> torch.Tensor:  # a per-block plane spread over its columns
        return p[name].double().repeat_interleave(block, dim=1)

    if w.fmt == "Q8_0":
        return per("d", 32) * p["qs"].double(), zero
    if w.fmt == "Q4_0":
        return per("d", 32) * (_nibbles(p["qs"], 16) - 8), zero
    if w.fmt == "Q4_1":
        return per("d", 32) * _nibbles(p["qs"], 16), per("m", 32)
    if w.fmt in ("Q4_K", "Q5_K"):
        q = _nibbles(p["qs"], 32)
        if w.fmt == "Q5_K":
            kk = torch.arange(k)
            c, r = kk % 256 // 64, kk % 64
            byte = p["qh"].to(torch.int64)[:, 32 * (kk // 256) + r % 32]
            q = q + 16 * ((byte >> (2 * c + r // 32)) & 1).double()
        return per("d", 256) * per("sc", 32) * q, -per("dmin", 256) * per("mn", 32)
    if w.fmt == "Q6_K":
        # llama.cpp: per 128 of a block (half h), l < 32: y[l + 32g] from ql[l + 32*(g%2)] (low
        # nibble for g < 2, high for g >= 2) and bits 2g..2g+1 of qh[l]
        kk = torch.arange(k)
        b, j = kk // 256, kk % 256
        h, gq, l = j // 128, j % 128 // 32, j % 32
        ql = p["ql"].to(torch.int64)[:, 128 * b + 64 * h + l + 32 * (gq % 2)]
        nib = torch.where(gq < 2, ql & 15, ql >> 4)
        qh = p["qh"].to(torch.int64)[:, 64 * b + 32 * h + l]
        q6 = nib | (((qh >> (2 * gq)) & 3) << 4)
        return per("d", 256) * per("sc", 16) * (q6 - 32).double(), zero
    if w.fmt == "fp8":
        return p["w"].double() * p["scale"].double()[:, None], zero
    if w.fmt == "int4":
        return per("scale", 128) * (_nibbles(p["qs"], 64) - 8), zero
    raise ValueError(w.fmt)


def outlier_rows(rows: int, k: int, seed: int, top: float = 3e4) -> torch.Tensor:
    """float32 rows of unit scale with four massive-activation channels (1e4 .. top)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    chans = [k // 4 * i + 7 for i in range(4)]
    x[:, chans] = torch.linspace(1e4, top, 4) * torch.tensor([1.0, -1.0, 1.0, -1.0])
    return x


def bound(x: torch.Tensor, mag: torch.Tensor, ref: torch.Tensor, out_eps: float) -> torch.Tensor:
    """Error bound of a float32-summed product over exactly carried weights, per output:
    out_eps |ref| (rounding the result; out_eps = one ulp of the output, twice the half ulp)
    + K 2^-24 sum |x| mag (float32 sums over K terms, γ_K; mag = terms(w), each weight's terms'
    magnitude: the weights enter as their integers and scales, so nothing else rounds)."""
    k = x.shape[1]
    return out_eps * ref.abs() + k * 2.0**-24 * (x.double().abs() @ mag.t())
