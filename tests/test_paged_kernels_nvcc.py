"""The CUDA kernels' sources compile, checked with nvcc where it is installed (no GPU needed).

MLX compiles a `mx.fast.cuda_kernel` with NVRTC only when a GPU evaluates it, so a source error in a
CUDA-only path would otherwise surface on a lent H200. This wraps each source the way MLX 0.32's
`build_kernel` does (mlx/backend/cuda/custom_kernel.cpp: a `__global__` function whose parameters are
each input as `const T*`, its `_shape` / `_strides` where the source names them, then the outputs;
the template arguments as `constexpr int` / `using`), with the few names of MLX's device header the
kernels use (AlignedVector, Shape, Strides), and compiles every variant for sm_90 at the shapes the
engine uses. Numerics are tested on the GPU (tests/test_paged_attention.py).
"""

import os
import shutil
import subprocess

import mlx.core as mx
import pytest

from parallm.engine import paged_kernels as pk

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")

_HEADER = """
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
  __device__ T& operator[](int i) { return val[i]; }
  __device__ T operator[](int i) const { return val[i]; }
};
}
"""

_CUDA_TYPES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.int32: "int32_t"}


def _kernel(name: str, inputs: list[tuple[str, mx.Dtype]], outputs: list[tuple[str, mx.Dtype]],
            template: list[tuple[str, object]], source: str) -> str:
    params = []
    for arg, dtype in inputs:
        params.append(f"    const {_CUDA_TYPES[dtype]}* {arg}")
        if f"{arg}_shape" in source:
            params.append(f"    const __grid_constant__ Shape {arg}_shape")
        if f"{arg}_strides" in source:
            params.append(f"    const __grid_constant__ Strides {arg}_strides")
    params += [f"    {_CUDA_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    consts = [f"  using {k} = {_CUDA_TYPES[v]};" if isinstance(v, mx.Dtype) else f"  constexpr int {k} = {v};"
              for k, v in template]
    return ("namespace mlx::core::cu {\n__global__ void " + name + "(\n" + ",\n".join(params) + ") {\n"
            + "\n".join(consts) + "\n" + source + "\n}\n}\n")


def _attention_kernels(dtype: mx.Dtype, dim: int, rep: int, kv_heads: int, tag: str,
                       fused_slots: bool = False) -> list[str]:
    """Every kernel at one shape; `fused_slots`: the stores as [kv_heads, slots, dim] (the engine's in-place
    reads), else as tiles."""
    template = [("T", dtype), ("D", dim), ("REP", rep), ("HKV", kv_heads), ("BS", 16), ("WARPS", pk.WARPS),
                ("SLOTS", 16 if fused_slots else 1)]
    common = [("q", dtype), ("k", dtype), ("v", dtype), ("tables", mx.int32), ("lengths", mx.int32),
              ("scale", mx.float32)]
    out = []
    for fused in (False, True):
        extra = [("xk", dtype), ("xv", dtype), ("slots", mx.int32)] if fused else [("written", mx.int32)]
        name = f"{tag}_{'fused' if fused else 'plain'}"
        out.append(_kernel(name + "_one", common + extra, [("out", dtype)], template,
                           pk._cuda_source(pk._CUDA_ONE_PASS, fused)))
        out.append(_kernel(name + "_split", common + extra,
                           [("part_o", mx.float32), ("part_m", mx.float32), ("part_l", mx.float32)], template,
                           pk._cuda_source(pk._CUDA_SPLIT, fused)))
    out.append(_kernel(tag + "_merge", [("part_o", mx.float32), ("part_m", mx.float32), ("part_l", mx.float32)],
                       [("out", dtype)], [("T", dtype), ("D", dim)], pk._CUDA_MERGE))
    out.append(_kernel(tag + "_write", [("k_store", dtype), ("v_store", dtype), ("xk", dtype), ("xv", dtype),
                                        ("slots", mx.int32)], [("done", mx.int32)], [("T", dtype)], pk._CUDA_WRITE))
    out.append(_kernel(tag + "_gather", [("k_store", dtype), ("v_store", dtype), ("slots", mx.int32),
                                         ("after", mx.float32)], [("k_out", dtype), ("v_out", dtype)],
                       [("T", dtype)], pk._CUDA_GATHER))
    return out


@pytest.mark.slow  # 15 s of nvcc: make test's 10-minute budget (clean clone, 2-core CI host)
def test_every_cuda_kernel_variant_compiles_for_sm90(tmp_path):
    kernels = []
    for dtype, dim, rep, kv_heads, slots in ((mx.bfloat16, 128, 3, 8, True), (mx.float16, 64, 4, 2, False),
                                             (mx.float32, 128, 1, 8, True), (mx.float32, 64, 2, 4, False)):
        kernels += _attention_kernels(dtype, dim, rep, kv_heads, f"k_{dtype}_{dim}_{rep}".replace("mlx.core.", ""),
                                      slots)
    source = tmp_path / "kernels.cu"
    source.write_text(_HEADER + "\n".join(kernels))
    done = subprocess.run([NVCC, "-arch=sm_90", "-c", str(source), "-o", str(tmp_path / "kernels.o"),
                           "-Xptxas", "-warn-spills"], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})  # conftest's OpenBLAS
    # preload crashes nvcc's front end
    assert done.returncode == 0, done.stderr[-4000:]
    assert "spill" not in done.stderr, done.stderr[-4000:]


def test_the_fused_variant_differs_from_the_plain_one_only_by_the_newest_key():
    plain, fused = pk._cuda_source(pk._CUDA_ONE_PASS, False), pk._cuda_source(pk._CUDA_ONE_PASS, True)
    assert "xk[" not in plain and "xk +" not in plain and "slots[" not in plain and "q_strides" not in plain
    assert "constexpr int NEW = 1;" in fused and "constexpr int NEW = 0;" in plain
    assert fused.count("const_cast<T*>") == 2  # the newest K and V, stored once by split 0
    for placeholder in ("STORE_NEWEST", "NEWEST_KEY", "Q_AT"):
        assert placeholder not in plain and placeholder not in fused
