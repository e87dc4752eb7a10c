"""SGLang's quantization seam: each linear layer has a `quant_method` (LinearMethodBase) that
holds its weight the way a checkpoint format wants and applies it (x @ W^T).

  base.py   LinearMethodBase (what a method does: load a checkpoint tensor's rows, apply)
  gguf.py   QuantizedWeight (a GGUF tensor still in its blocks) and GGUFLinearMethod, which keeps
            the blocks and multiplies them with the C++ integer kernel (csrc/quant_kernels.cpp)
  w8a8_int8.py  --quantization w8a8_int8: a safetensors checkpoint's rows quantized to Q8_0
            blocks as they load, then GGUFLinearMethod's way

linear.py's UnquantizedLinearMethod is the default (F.linear, or the CPU's packed bf16 GEMM).
model_executor/model_loader.py gives GGUFLinearMethod, before loading, to the layers whose GGUF
tensors stay in their blocks (--quantization), so the checkpoint chooses the method and the model
files never change."""

from radixserve.layers.quantization.base import LinearMethodBase
from radixserve.layers.quantization.gguf import GGUFLinearMethod, QuantizedWeight, kernel_types, quant_matmul

__all__ = ["GGUFLinearMethod", "LinearMethodBase", "QuantizedWeight", "kernel_types", "quant_matmul"]
