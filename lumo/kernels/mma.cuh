// The tensor-core operations shared by the GEMVs (linear.cu), the attention kernel (attention.cu) and the
// chunked GDN walk (gdn_chunk.cu).
#pragma once

// c += A B on mma.sync m16n8k16 (bf16 in, fp32 accumulate): A = 4 registers of bf16 pairs (row g k-lo,
// row g + 8 k-lo, row g k-hi, row g + 8 k-hi), B = 2 (k-lo, k-hi of column g), c = rows g / g + 8 x
// columns 2t, 2t + 1 of lane (g, t).
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d += A B on mma.sync m16n8k8 (tf32 in, fp32 accumulate): A = 4 registers (row g k t, row g + 8 k t, row g
// k t + 4, row g + 8 k t + 4), B = 2 (k t, k t + 4 of column g), d as in mma_bf16.
__device__ __forceinline__ void mma_tf32(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
