// What one core can issue, in cycles at the clock this measures itself (a chain of dependent
// scalar adds): 512-bit VNNI dot products and FMAs with independent accumulators, and a
// straight-line copy of the paired kquant kernel's work for one row and pair of blocks (eight
// dot products with their activations from memory, the float part, four rows interleaved).
//
//   gcc -O2 -o /tmp/pipe_bound experiments/kquant/pipe_bound.c && taskset -c 0 /tmp/pipe_bound
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TEN(I) \
  I " %%zmm20, %%zmm21, %%zmm0\n\t" I " %%zmm20, %%zmm21, %%zmm1\n\t" I " %%zmm20, %%zmm21, %%zmm2\n\t" \
  I " %%zmm20, %%zmm21, %%zmm3\n\t" I " %%zmm20, %%zmm21, %%zmm4\n\t" I " %%zmm20, %%zmm21, %%zmm5\n\t" \
  I " %%zmm20, %%zmm21, %%zmm6\n\t" I " %%zmm20, %%zmm21, %%zmm7\n\t" I " %%zmm20, %%zmm21, %%zmm8\n\t" \
  I " %%zmm20, %%zmm21, %%zmm9\n\t"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9"
#define ROW(A, F, X)                                                                            \
  "vpxord %%zmm" A ",%%zmm" A ",%%zmm" A "\n\t"                                                   \
  "vpdpbusd " X "+0(%0), %%zmm21, %%zmm" A "\n\t vpdpbusd " X "+64(%0), %%zmm22, %%zmm" A "\n\t"   \
  "vpdpbusd " X "+128(%0), %%zmm23, %%zmm" A "\n\t vpdpbusd " X "+192(%0), %%zmm24, %%zmm" A "\n\t" \
  "vpdpbusd " X "+256(%0), %%zmm25, %%zmm" A "\n\t vpdpbusd " X "+320(%0), %%zmm26, %%zmm" A "\n\t" \
  "vpdpbusd " X "+384(%0), %%zmm27, %%zmm" A "\n\t vpdpbusd " X "+448(%0), %%zmm28, %%zmm" A "\n\t" \
  "vcvtdq2ps %%zmm" A ", %%zmm" A "\n\t vmulps %%zmm29, %%zmm" A ", %%zmm" A "\n\t"                \
  "vfmadd231ps " X "+512(%0), %%zmm" A ", %%zmm" F "\n\t"                                        \
  "vfmadd231ps " X "+576(%0), %%zmm30, %%zmm" F "\n\t"

int main(void) {
  const long n = 50000000;
  long x = 0;
  double t0 = now();
  for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double hz = 4.0 * n / (now() - t0);
  printf("clock about %.2f GHz\n", hz / 1e9);
  t0 = now();
  for (long i = 0; i < n; ++i) __asm__ volatile(TEN("vpdpbusd")::: CLOBBER);
  printf("vpdpbusd zmm, independent: %.2f cycles each\n", (now() - t0) * hz / (10.0 * n));
  t0 = now();
  for (long i = 0; i < n; ++i) __asm__ volatile(TEN("vfmadd231ps")::: CLOBBER);
  printf("vfmadd231ps zmm, independent: %.2f cycles each\n", (now() - t0) * hz / (10.0 * n));
  char* buf = aligned_alloc(64, 4096);
  for (int i = 0; i < 4096; ++i) buf[i] = (char)i;
  t0 = now();
  for (long i = 0; i < n; ++i)
    __asm__ volatile(ROW("0", "10", "0") ROW("2", "11", "640") ROW("4", "12", "1280") ROW("6", "13", "1920")
                     :: "r"(buf) : "xmm0", "xmm2", "xmm4", "xmm6", "xmm10", "xmm11", "xmm12", "xmm13");
  printf("one row and pair of blocks (8 dot products, float part), 4 rows interleaved: %.2f cycles\n",
         (now() - t0) * hz / (4.0 * n));
  free(buf);
  return 0;
}
