"""Linear layers whose weight is prepared once, at load time, for the fastest kernel.

On CPU, `F.linear` hands oneDNN a plain row-major weight and oneDNN reorders it into its
blocked layout on every call; at batch 1 that reorder costs as much as the product itself
(the 49152 x 576 lm_head: ~3.4 ms plain, ~1.5 ms prepacked, bf16, one thread). Prepacking
the weight once removes it. The bf16 results are bit-identical to `F.linear` (same oneDNN
kernel); fp32 ones differ by re-association only (oneDNN instead of MKL's sgemm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from entropic.model.quant import Int4Blocks, quantize_int4, quantize_int8


class Linear:
    """y = x @ weight.T (+ bias) with F.linear: the portable fallback (any device)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    @property
    def numel(self) -> int:
        """Parameters (weight and bias) of the layer."""
        return self.weight.numel() + (self.bias.numel() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# the batch-size hint fp32 weights are packed with (PackedLinear)
PACK_ROWS_FP32 = 2048


class PackedLinear(Linear):
    """y = x @ weight.T (+ bias) through oneDNN with the weight reordered once (CPU only).

    The packed tensor is opaque (only `_linear_pointwise` can read it), so the plain
    weight is not kept: a tied embedding keeps its own plain copy for the lookup.

    Batch invariance: a row's result should not depend on the other rows of its call, or a
    request's tokens would depend on who shares its step. oneDNN picks its kernel by shape,
    and two shape effects break that (`row_invariance` probes both once per shape):
    - for some shapes (e.g. in_features = 1536) its one-row kernel sums in another order:
      a lone row is then run as two (~6 us more per call);
    - on CPUs with AMX its kernels change their blocking of K with the number of rows
      (e.g. rows of a 576 x 1536 product differ beyond ~130 rows): calls are then cut
      into pieces of at most `max_rows` rows, a size below the first change."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        # The layout oneDNN picks for a batch-size hint serves any batch size. fp32: the hint
        # of a large batch (PACK_ROWS_FP32): on an AVX2 EPYC its layout gave the same bits
        # for every row count (the one-row layout needs a lone row padded to two) and ran
        # 0.3-0.9x the time at 1 to 64 rows and 2048 (docs/performance.md). bf16: the
        # decode layout (batch size 1), as measured on the CPUs with native bf16.
        hint = PACK_ROWS_FP32 if weight.dtype == torch.float32 else 1
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=hint)
        self._numel = weight.numel()
        self._pad_single_row, self.max_rows = row_invariance(self.weight, bias,
                                                             self.in_features)

    @property
    def numel(self) -> int:
        return self._numel + (self.bias.numel() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            if self._pad_single_row and x.shape[0] == 1:
                return _packed_mm(torch.cat((x, x)), self.weight, self.bias)[:1]
            cap = self.max_rows
            if cap is not None and x.shape[0] > cap:
                return torch.cat([self(x[i:i + cap]) for i in range(0, x.shape[0], cap)])
        return _packed_mm(x, self.weight, self.bias)


def _packed_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# (out_features, in_features, dtype, has bias, threads) -> row_invariance's answer
_ROW_INVARIANCE: dict[tuple, tuple[bool, int | None]] = {}
# Row counts a call is probed at on AMX CPUs, and the largest call cut to when one differs.
_PROBE_ROWS = (2, 3, 5, 8, 16, 17, 31, 33, 48, 64, 65, 96, 127, 128, 129, 160, 192, 200, 256,
               300, 384, 512, 768, 1024, 2048)
_CUT_SIZES = (2048, 1024, 512, 256, 128, 64, 32, 16)


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (oneDNN then uses AMX kernels for bf16 products)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def row_invariance(packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                   rows: int = 32) -> tuple[bool, int | None]:
    """(pad a lone row to two, largest call in rows or None) that keep every row's result
    independent of the other rows of its call, for this shape on this CPU.

    oneDNN picks its kernel by shape, not by values, so a shape is probed once. Output
    rounding hides most summation-order differences, so the probe's inputs span a wide
    range of magnitudes: then a different order shows on several of `rows` rows. The
    many-row probe runs for bf16 on AMX CPUs only (elsewhere, and in fp32, oneDNN keeps rows
    for any count >= 2, measured up to 2048);
    it tiles the same `rows` rows to each probed count and compares them with one call."""
    key = (packed.shape[0], in_features, packed.dtype, bias is not None,
           torch.get_num_threads())
    if key not in _ROW_INVARIANCE:
        gen = torch.Generator().manual_seed(0)
        scale = torch.exp2(torch.randint(-8, 9, (rows, in_features), generator=gen).float())
        x = (torch.randn(rows, in_features, generator=gen) * scale).to(packed.dtype)
        batched = _packed_mm(x, packed, bias)
        pad = any(not torch.equal(_packed_mm(x[r:r + 1].clone(), packed, bias)[0], batched[r])
                  for r in range(rows))
        cap = None
        if packed.dtype == torch.bfloat16 and has_amx():  # AMX kernels are bf16 (and int8)
            first_bad = next((m for m in _PROBE_ROWS if not torch.equal(
                _packed_mm(_tile(x, m), packed, bias), _tile(batched, m))), None)
            if first_bad is not None:
                cap = next((c for c in _CUT_SIZES if c < first_bad), 1)
        _ROW_INVARIANCE[key] = (pad, cap)
    return _ROW_INVARIANCE[key]


def _tile(x: torch.Tensor, m: int) -> torch.Tensor:
    """The rows of x repeated to m rows."""
    return x.repeat(-(-m // x.shape[0]), 1)[:m].contiguous()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this build and device can run `PackedLinear` on `weight` (CPU, fp32 or bf16
    with native oneDNN bf16 support; fp16 and other devices keep `F.linear`)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class Int4Linear(Linear):
    """y = x @ W.T (+ bias) with W in 4-bit groups (`Int4Blocks`), through torch's CPU
    weight-only int4 kernel: the weight is read as 4-bit codes plus a bf16 scale and zero
    per group of 32, i.e. ~0.63 bytes per parameter. Activations are bf16; scale and offset are
    rounded to bf16 (the kernel's format), the codes are exact."""

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = blocks.shape
        self.out_features, self.in_features = n, k
        self.bias = bias
        self.group_size = blocks.group_size
        # The kernel packs rows in sixteens: other counts get zero rows, sliced off the output.
        pad = -n % 16
        q, scale, offset = blocks.q, blocks.scale, blocks.offset
        if pad:
            q, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, offset))
        self._rows = n if pad else None
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # The kernel computes (q - 8) * scale + zero, so zero = offset + 8 * scale.
        zero = offset + 8 * scale
        self.scales_zeros = (torch.stack((scale, zero), dim=-1).transpose(0, 1)
                             .to(dtype).contiguous())
        self._numel = n * k

    @property
    def numel(self) -> int:
        return self._numel + (self.bias.numel() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group_size,
                                                       self.scales_zeros)
        if self._rows is not None:
            y = y[:, :self._rows]
        return y if self.bias is None else y.add_(self.bias)


def _level_tiles(codes: torch.Tensor) -> torch.Tensor:
    """Codes in tiles [tiles, n, 4, 32] (each column's 32 bytes of a 128-byte block in turn)
    in the order the native level in use reads them: so at most levels; at avx2
    (`int4_run()` 4) as 8 chunks of 4 bytes a column, the 4 columns side by side
    ([tiles, n, 8, 4, 4], quant_linear.cpp)."""
    if torch.ops.entropic.int4_run() == 4:
        codes = codes.unflatten(3, (8, 4)).transpose(2, 3)
    return codes.contiguous()


class NativeInt4Linear(Linear):
    """y = x @ W.T (+ bias) with W in 4-bit groups of 32, through entropic's own kernel
    (`entropic.int4_linear`, CPUs with AVX2 or better): the codes are exact bf16 numbers, so
    a group is one dot product with exact products and fp32 sums (one AVX512-BF16 instruction,
    or the same fused multiply-adds in fp32 on AVX-512 without bf16); at the AVX2 level the
    codes meet the activations rounded to int16 per group of 32 in exact integer dot products
    (`torch.ops.entropic.quant_activations()` says which). Scale and offset are fp32 (a
    GGUF's fp16 values exactly), or at the AVX2 level fp16 where that is exact
    (`half_scales`). Each output is summed in a fixed order, so a row's result
    does not depend on the other rows of the call."""

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None = None,
                 half_scales: bool | None = None) -> None:
        n, k = blocks.shape
        if k % 32:
            raise ValueError(f"the native int4 kernel needs in_features ({k}) to be a "
                             f"multiple of 32")
        self.out_features, self.in_features = n, k
        self.bias = bias
        avx2 = torch.ops.entropic.int4_run() == 4
        # fp16 scales and offsets (avx2 only): where they are exact in fp16, as a GGUF's
        # Q4_0/Q4_1 are, 5 bytes of weights per group of 32 and column instead of 6.
        # `half_scales` None: where exact; True: required (error if not exact); False: never.
        exact = avx2 and all(bool((v.float().half().float() == v.float()).all())
                             for v in (blocks.scale, blocks.offset))
        if half_scales and not exact:
            raise ValueError("half_scales=True needs the avx2 level and scales and offsets "
                             "that are exact in float16")
        self.half_scales = exact if half_scales is None else bool(half_scales)
        pad = -n % 4
        if self.half_scales:
            # the offsets themselves (the avx2 kernel multiplies the codes as they are)
            self.offsets = blocks.offset.half().contiguous()
        else:
            # the kernel reads each code as the bf16 number 128 + q: take 128 * scale off here
            self.offsets = (blocks.offset.float() - 128 * blocks.scale.float()).contiguous()
        # codes and scales in tiles of 4 output columns (zero columns pad the last tile),
        # each tile's data contiguous: [tiles, pairs, 4, 32] bytes and [tiles, groups, 4]
        codes = F.pad(blocks.pack_group_pairs(), (0, 0, 0, pad))
        self.weight = _level_tiles(codes.view(-1, 4, codes.shape[1] // 32, 32).transpose(1, 2))
        scale = F.pad(blocks.scale.float(), (0, 0, 0, pad))
        scale = scale.view(-1, 4, scale.shape[1]).transpose(1, 2)
        self.scale = (scale.half() if self.half_scales else scale).contiguous()
        self._numel = n * k

    @property
    def numel(self) -> int:
        return self._numel + (self.bias.numel() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.entropic.int4_linear(x, self.weight, self.scale, self.offsets)
        return y if self.bias is None else y.add_(self.bias)


class NativeInt8Linear(Linear):
    """y = x @ W.T (+ bias) with W as int8 per output channel (`quantize_int8`), through
    entropic's kernel (`entropic.int8_linear`, CPUs with AVX2 or better): the products are
    exact (with avx512_bf16 each byte is split into two nibbles that are exact bf16 numbers;
    on AVX-512 without it a byte is an fp32 number; at the AVX2 level an int16 against the
    activations rounded to int16 per group of 32) and summed in a fixed order (a row's
    result does not depend on the other rows of the call)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = n, k = weight.shape
        if k % 32:
            raise ValueError(f"the native int8 kernel needs in_features ({k}) to be a "
                             f"multiple of 32")
        self.bias = bias
        q, scale = quantize_int8(weight)
        codes = F.pad((q.to(torch.int16) + 128).to(torch.uint8), (0, 0, 0, -n % 4))
        # tiles of 4 output columns, each tile's 32-byte runs contiguous: [tiles, k/32, 4, 32]
        self.weight = _level_tiles(codes.view(-1, 4, k // 32, 32).transpose(1, 2))
        self.scale = scale.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.entropic.int8_linear(x, self.weight, self.scale)
        return y if self.bias is None else y.add_(self.bias)


class Int8Linear(Linear):
    """y = x @ W.T (+ bias) with W as int8 per output channel (symmetric, one scale per
    row), through torch's CPU weight-only int8 kernel: 1 byte per parameter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        q, scale = quantize_int8(weight)
        self.weight, self.scale = q, scale.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        return y if self.bias is None else y.add_(self.bias)


def check_quantization(quantization: str | None, dtype: torch.dtype,
                       device: torch.device | str) -> None:
    """Raise ValueError unless this quantization can run with this dtype on this device."""
    if quantization is None:
        return
    if quantization not in ("int8", "int4"):
        raise ValueError(f"quantization must be None, 'int8' or 'int4', got {quantization!r}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU only (torch's "
                         f"weight-only {quantization} CPU kernels), not on {device}")
    if dtype != torch.bfloat16:
        # The kernels exist for fp32 too, but without vectorization: 10-50x slower than bf16.
        raise ValueError(f"quantization={quantization!r} needs dtype='bfloat16' "
                         f"(activations), got {str(dtype).removeprefix('torch.')}")


def make_linear(weight: torch.Tensor | Int4Blocks, bias: torch.Tensor | None = None,
                packed: bool = True, quantization: str | None = None,
                native_int4: bool = False) -> Linear:
    """The fastest available linear for `weight` [out, in]: weight-only int8 / int4 when
    `quantization` asks for it (a float weight is quantized, 4-bit blocks are used as they
    are; `native_int4` picks entropic's int4 / int8 kernels over torch's), else prepacked oneDNN
    where possible, else F.linear."""
    if quantization == "int4":
        blocks = weight if isinstance(weight, Int4Blocks) else quantize_int4(weight)
        return NativeInt4Linear(blocks, bias) if native_int4 else Int4Linear(blocks, bias)
    if quantization == "int8":
        return NativeInt8Linear(weight, bias) if native_int4 else Int8Linear(weight, bias)
    if packed and can_pack(weight):
        return PackedLinear(weight, bias)
    return Linear(weight, bias)
