"""The GGUF weight types the cuda backend serves, one row each, and the kernels each row
gives (kernels/cuda/quant_matrix.cu, compiled once per type).

Adding a type is its decoder in kernels/cuda/quant_blocks.cuh (a struct named as the ggml
type, with its tables in iq_tables.cuh if it has any) and its row in `WEIGHT_TYPES`; the
kernels, their signatures (kernels/cuda_kernels.py), the loader's choice, the GEMV, the tile
path and the embedding lookup follow from the row. Every type has

- `dequant_<name>_bf16` / `_f32`: the loader's expansion and the tile path's;
- `gemv_<name>`: the fused GEMV on bf16 activations, float math;
- `embed_<name>`: the embedding lookup over a table of that type;
- `gemv8_<name>` for the block types (integer values times scales): the GEMV on int8
  activations with dp4a. F32 / F16 / BF16 have no integers to multiply;
- `moe_gemv_<name>`: the float GEMV over a mixture of experts' 3-D tensor of the type, one
  launch for all the chunks of rows a round routed to its experts (kernels/cuda_moe.py).

A type's kernels are module `quant_matrix_<name>` (the source compiled with the type's
defines), compiled on first use: a model compiles the modules of the types it holds
(`QuantizedLinear.reserve` loads them at load time) and no others.

What a matrix of each type is on the device (`held`, with `weights="quantized"`):
- "blocks": the file's bytes, `DeviceQuantizedMatrix` (kernels/cuda_quantized.py): every
  block type, and F16, which stays 2 bytes a value and is not rounded to bf16: its 11-bit
  significands are kept, and the GEMV (decode) multiplies them as they are. The tile path
  (prefill) rounds each tile to bf16 for cuBLASLt, whose bf16 GEMM is the engine's only
  one (a GEMM in F16 would need the activations in F16, which overflow past 65504 where
  bf16 ones do not): an error of the size the bf16 activations already carry.
- "bf16": a bf16 `DeviceTensor`, every product by cuBLASLt. BF16 matrices are uploaded as
  they are (2 bytes a value either way); their GEMV (`gemv_bf16`, on a
  `DeviceQuantizedMatrix` of BF16, where the tile path is cuBLASLt on the matrix as it is)
  is timed against cuBLASLt by benchmarks/bench_gemm.py --quantized bf16, and replaces it
  only once a GPU has measured it faster: a hand-written kernel has to earn its place over
  the library. F32 matrices become bf16 at load (half the bytes every product reads), the
  GEMMs' input type; their GEMV likewise serves a matrix held as F32, which the loader
  does not make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class WeightType:
    """One GGUF type's kernels on cuda. `held`: what a matrix of it is on the device (the
    module's docstring); `tiles`: whether the tile path dequantizes it (BF16 is read as it
    is)."""

    qtype: GGMLQuantizationType
    held: Literal["blocks", "bf16"] = "blocks"
    tiles: bool = True

    @property
    def name(self) -> str:
        """The type in the kernels' names (gemv_<name>) and in `--quantized` arguments."""
        return self.qtype.name.lower()

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def integer(self) -> bool:
        """A block type: its values are integers times scales, so it has the int8 GEMV."""
        return self.block_size > 1

    @property
    def module(self) -> str:
        return f"quant_matrix_{self.name}"

    @property
    def defines(self) -> tuple[tuple[str, str], ...]:
        """What compiles quant_matrix.cu into this type's module."""
        return (("WEIGHT_TYPE", self.qtype.name), ("WEIGHT_NAME", self.name),
                ("WEIGHT_INTEGER", str(int(self.integer))))

    @property
    def gemv(self) -> str:
        return f"gemv_{self.name}"

    @property
    def gemv8(self) -> str | None:
        return f"gemv8_{self.name}" if self.integer else None

    @property
    def embed(self) -> str:
        return f"embed_{self.name}"

    @property
    def moe_gemv(self) -> str:
        return f"moe_gemv_{self.name}"

    def dequant(self, out_dtype: str) -> str:
        """The expansion to "bf16" or "f32"."""
        return f"dequant_{self.name}_{out_dtype}"

    def dequant_threads(self, n: int) -> int:
        """The threads `dequant` runs on for n values: one per 32-value unit of a block
        type, one per value of a float type."""
        return n // 32 if self.integer else n

    @property
    def kernels(self) -> tuple[str, ...]:
        names = (self.dequant("bf16"), self.dequant("f32"), self.gemv, self.embed, self.gemv8,
                 self.moe_gemv)
        return tuple(n for n in names if n is not None)


# Every type gguf-py 0.19 reads (its quants.py), in ggml's order, and Q1_0, which it sizes but
# cannot read (loader/ggml_quants.py).
WEIGHT_TYPES: dict[GGMLQuantizationType, WeightType] = {t.qtype: t for t in (
    WeightType(Q.F32, held="bf16"),
    WeightType(Q.F16),
    WeightType(Q.Q4_0),
    WeightType(Q.Q4_1),
    WeightType(Q.Q5_0),
    WeightType(Q.Q5_1),
    WeightType(Q.Q8_0),
    WeightType(Q.Q2_K),
    WeightType(Q.Q3_K),
    WeightType(Q.Q4_K),
    WeightType(Q.Q5_K),
    WeightType(Q.Q6_K),
    WeightType(Q.IQ2_XXS),
    WeightType(Q.IQ2_XS),
    WeightType(Q.IQ3_XXS),
    WeightType(Q.IQ1_S),
    WeightType(Q.IQ4_NL),
    WeightType(Q.IQ3_S),
    WeightType(Q.IQ2_S),
    WeightType(Q.IQ4_XS),
    WeightType(Q.IQ1_M),
    WeightType(Q.BF16, held="bf16", tiles=False),
    WeightType(Q.TQ1_0),
    WeightType(Q.TQ2_0),
    WeightType(Q.MXFP4),
    WeightType(Q.NVFP4),
    WeightType(Q.Q1_0),
)}

BY_NAME: dict[str, WeightType] = {t.name: t for t in WEIGHT_TYPES.values()}
