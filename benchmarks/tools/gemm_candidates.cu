// Times cuBLASLt's candidate algorithms for row-major bf16 GEMMs, as two formulations:
//   swap: column-major C^T[n, m] = B^T[n, k] @ A^T[k, m] (what CublasLtGemm describes);
//   row:  C[m, n] = A[m, k] @ B[k, n] with every layout CUBLASLT_ORDER_ROW.
// Each candidate runs back to back (as a training loop runs GEMMs), so power-limited
// clocks are part of its time. Used to find why jax_ub's chunk GEMMs ran slower than
// XLA's dot at some shapes (profile: a different kernel). Not part of the library.
//
// Usage: gemm_candidates [--candidates N] [--runs R] m,k,n [m,k,n ...]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda_tool.h"

namespace {

using jax_ub_tool::Check;
using jax_ub_tool::FillRandom;

struct Problem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  const void* first_ptr = nullptr;
  const void* second_ptr = nullptr;
};

cublasLtMatrixLayout_t Layout(uint64_t rows, uint64_t cols, int64_t ld, bool row_order) {
  cublasLtMatrixLayout_t l;
  Check(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, rows, cols, ld), "layout");
  if (row_order) {
    const cublasLtOrder_t order = CUBLASLT_ORDER_ROW;
    Check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order)),
          "layout order");
  }
  return l;
}

Problem Describe(bool row, int64_t m, int64_t k, int64_t n, const void* a, const void* b) {
  Problem p;
  Check(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  if (row) {
    p.first = Layout(m, k, k, true);
    p.second = Layout(k, n, n, true);
    p.out = Layout(m, n, n, true);
    p.first_ptr = a;
    p.second_ptr = b;
  } else {
    p.first = Layout(n, k, n, false);
    p.second = Layout(k, m, k, false);
    p.out = Layout(n, m, n, false);
    p.first_ptr = b;
    p.second_ptr = a;
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  int candidates = 32, runs = 10;
  std::vector<std::string> shapes;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--candidates") && i + 1 < argc) {
      candidates = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::atoi(argv[++i]);
    } else {
      shapes.push_back(argv[i]);
    }
  }
  cublasLtHandle_t handle;
  Check(cublasLtCreate(&handle), "cublasLtCreate");
  const size_t ws_bytes = 32u << 20;
  void* ws;
  Check(cudaMalloc(&ws, ws_bytes), "workspace");
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "stream");
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "event");
  Check(cudaEventCreate(&end), "event");
  for (const std::string& s : shapes) {
    long long m, k, n;
    if (std::sscanf(s.c_str(), "%lld,%lld,%lld", &m, &k, &n) != 3) {
      std::fprintf(stderr, "bad shape %s (want m,k,n)\n", s.c_str());
      return 2;
    }
    __nv_bfloat16 *a, *b, *c;
    Check(cudaMalloc(&a, m * k * 2), "a");
    Check(cudaMalloc(&b, k * n * 2), "b");
    Check(cudaMalloc(&c, m * n * 2), "c");
    FillRandom(a, m * k, 1, 1.0f, stream);
    FillRandom(b, k * n, 2, 0.01f, stream);
    const double tflop = 2.0 * m * k * n / 1e12;
    std::printf("\n== m=%lld k=%lld n=%lld (%.3f TFLOP per GEMM)\n", m, k, n, tflop);
    for (bool row : {false, true}) {
      Problem p = Describe(row, m, k, n, a, b);
      cublasLtMatmulPreference_t pref;
      Check(cublasLtMatmulPreferenceCreate(&pref), "pref");
      size_t ws_pref = ws_bytes;
      Check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &ws_pref, sizeof(ws_pref)),
            "pref ws");
      std::vector<cublasLtMatmulHeuristicResult_t> results(candidates);
      int found = 0;
      cublasStatus_t hs =
          cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.first, p.second, p.out, p.out, pref,
                                         candidates, results.data(), &found);
      cublasLtMatmulPreferenceDestroy(pref);
      const char* name = row ? "row" : "swap";
      if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
        std::printf("%s: no candidates (%s)\n", name, cublasLtGetStatusName(hs));
        continue;
      }
      const float alpha = 1.0f, beta = 0.0f;
      float best = 1e30f;
      int best_i = -1;
      for (int i = 0; i < found; ++i) {
        auto run = [&] {
          return cublasLtMatmul(handle, p.desc, &alpha, p.first_ptr, p.first, p.second_ptr,
                                p.second, &beta, c, p.out, c, p.out, &results[i].algo, ws, ws_bytes,
                                stream);
        };
        if (run() != CUBLAS_STATUS_SUCCESS) {
          std::printf("%s #%2d: cannot run\n", name, i);
          continue;
        }
        std::vector<float> per_run;
        for (int round = 0; round < 3; ++round) {
          Check(cudaEventRecord(begin, stream), "record");
          for (int r = 0; r < runs; ++r) Check(run(), "matmul");
          Check(cudaEventRecord(end, stream), "record");
          Check(cudaEventSynchronize(end), "sync");
          float ms = 0;
          Check(cudaEventElapsedTime(&ms, begin, end), "elapsed");
          per_run.push_back(ms / runs);
        }
        std::sort(per_run.begin(), per_run.end());
        const float med = per_run[1];
        if (med < best) best = med, best_i = i;
        std::printf(
            "%s #%2d: %8.4f ms %6.1f TFLOP/s  algo %d tile %d stages %d cluster %d "
            "splitk %d swizzle %d\n",
            name, i, med, tflop / (med * 1e-3),
            jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_ID),
            jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
            jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
            jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
            jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
            jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
      }
      std::printf("%s best: #%d %.4f ms of %d candidates\n", name, best_i, best, found);
      cublasLtMatrixLayoutDestroy(p.first);
      cublasLtMatrixLayoutDestroy(p.second);
      cublasLtMatrixLayoutDestroy(p.out);
      cublasLtMatmulDescDestroy(p.desc);
    }
    Check(cudaFree(a), "free");
    Check(cudaFree(b), "free");
    Check(cudaFree(c), "free");
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaStreamDestroy(stream);
  cudaFree(ws);
  cublasLtDestroy(handle);
  return 0;
}
