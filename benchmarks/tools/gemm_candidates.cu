// Times cuBLASLt's candidate algorithms for row-major bf16 GEMMs, as two formulations:
//   swap: column-major C^T[n, m] = B^T[n, k] @ A^T[k, m] (what CublasLtGemm describes);
//   row:  C[m, n] = A[m, k] @ B[k, n] with every layout CUBLASLT_ORDER_ROW.
// Each candidate runs back to back (as a training loop runs GEMMs), so power-limited
// clocks are part of its time. Used to find why jax_ub's chunk GEMMs ran slower than
// XLA's dot at some shapes (profile: a different kernel). Not part of the library.
// --windows W,W,...: instead, the swap formulation's candidates timed in rounds (shuffled
// orders, no host wait within a round) of blocks W ms long, each block's second half timed
// (W = 0: tuning's way, 3 runs a block, all timed): which block length ranks the
// candidates as long loops of each do.
//
// --copies C: runs take turns over C copies of the operands (C > 1: as many as leave none
// in L2 by the next run of it, as a training step's GEMMs find their inputs), instead of one.
// Beside the swap formulation's candidates, cuBLAS's own GEMM (cublasGemmEx, its default
// algorithm, a 32 MiB workspace: what torch.mm runs) is timed alike, as "cuBLAS": the kernel
// cuBLAS picks for itself may differ from cuBLASLt's first heuristic pick, or run as it
// with another configuration.
//
// Usage: gemm_candidates [--candidates N] [--runs R] [--windows W,... [--rounds N]]
//                        [--copies C] m,k,n [m,k,n ...]
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
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

// Each candidate's median ms a run, per block length in `windows` (see the header).
void TimeWindows(const std::vector<int>& windows, int rounds, const std::vector<float>& est_ms,
                 const std::vector<int>& tiles, cudaStream_t stream,
                 const std::function<void(int)>& run) {
  const int count = static_cast<int>(est_ms.size());
  std::vector<cudaEvent_t> events(2 * count);
  for (cudaEvent_t& e : events) Check(cudaEventCreate(&e), "event");
  std::vector<std::vector<float>> medians(count);
  for (int w : windows) {
    std::vector<std::vector<float>> ms(count);
    std::vector<int> warm(count), timed(count);
    for (int i = 0; i < count; ++i) {
      const int half = std::max(1, static_cast<int>(0.5 * w / est_ms[i] + 0.5));
      warm[i] = w == 0 ? 0 : half;
      timed[i] = w == 0 ? 3 : half;
    }
    for (int r = 0; r < rounds; ++r) {
      std::vector<int> order(count);
      for (int i = 0; i < count; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), std::mt19937(r + 1000 * w));
      for (int i : order) {
        for (int j = 0; j < warm[i]; ++j) run(i);
        Check(cudaEventRecord(events[2 * i], stream), "record");
        for (int j = 0; j < timed[i]; ++j) run(i);
        Check(cudaEventRecord(events[2 * i + 1], stream), "record");
      }
      Check(cudaStreamSynchronize(stream), "sync");
      for (int i = 0; i < count; ++i) {
        float t = 0;
        Check(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]), "elapsed");
        ms[i].push_back(t / timed[i]);
      }
    }
    for (int i = 0; i < count; ++i) {
      std::sort(ms[i].begin(), ms[i].end());
      medians[i].push_back(ms[i][ms[i].size() / 2]);
    }
  }
  std::printf("windows: candidate tile, then median ms a run (rank) per block of");
  for (int w : windows) std::printf(" %d ms", w);
  std::printf(", %d rounds\n", rounds);
  for (int i = 0; i < count; ++i) {
    if (tiles[i] < 0) {
      std::printf("cuBLAS's own:");  // cublasGemmEx, not one of cuBLASLt's candidates
    } else {
      std::printf("#%2d tile %3d:", i, tiles[i]);
    }
    for (size_t c = 0; c < windows.size(); ++c) {
      int rank = 1;
      for (int j = 0; j < count; ++j) rank += medians[j][c] < medians[i][c];
      std::printf("  %8.4f (%d)", medians[i][c], rank);
    }
    std::printf("\n");
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
}

}  // namespace

int main(int argc, char** argv) {
  int candidates = 32, runs = 10, rounds = 5, copies = 1;
  std::vector<int> windows;
  std::vector<std::string> shapes;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--candidates") && i + 1 < argc) {
      candidates = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--copies") && i + 1 < argc) {
      copies = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--windows") && i + 1 < argc) {
      for (const char* w = argv[++i]; *w != '\0';) {
        char* end = nullptr;
        windows.push_back(static_cast<int>(std::strtol(w, &end, 10)));
        w = *end == ',' ? end + 1 : end;
      }
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
  // cuBLAS's own GEMM, set up as torch sets its handle on Hopper: the stream, a workspace of
  // its own (cuBLASLt's runs use `ws`) of 32 MiB.
  cublasHandle_t blas;
  Check(cublasCreate(&blas), "cublasCreate");
  Check(cublasSetStream(blas, stream), "cublasSetStream");
  void* blas_ws;
  Check(cudaMalloc(&blas_ws, ws_bytes), "cuBLAS workspace");
  Check(cublasSetWorkspace(blas, blas_ws, ws_bytes), "cublasSetWorkspace");
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "event");
  Check(cudaEventCreate(&end), "event");
  for (const std::string& s : shapes) {
    long long m, k, n;
    if (std::sscanf(s.c_str(), "%lld,%lld,%lld", &m, &k, &n) != 3) {
      std::fprintf(stderr, "bad shape %s (want m,k,n)\n", s.c_str());
      return 2;
    }
    // Copy j of the operands: a[j], b[j]; each run takes the next copy.
    std::vector<__nv_bfloat16*> a(copies), b(copies);
    __nv_bfloat16* c;
    for (int j = 0; j < copies; ++j) {
      Check(cudaMalloc(&a[j], m * k * 2), "a");
      Check(cudaMalloc(&b[j], k * n * 2), "b");
      FillRandom(a[j], m * k, 1 + 2 * j, 1.0f, stream);
      FillRandom(b[j], k * n, 2 + 2 * j, 0.01f, stream);
    }
    Check(cudaMalloc(&c, m * n * 2), "c");
    int turn = 0;  // runs so far: the next run's copy
    const double tflop = 2.0 * m * k * n / 1e12;
    std::printf("\n== m=%lld k=%lld n=%lld (%.3f TFLOP per GEMM, %d operand copies)\n", m, k, n,
                tflop, copies);
    for (bool row : {false, true}) {
      if (row && !windows.empty()) break;  // the windows time the swap formulation only
      std::vector<Problem> ps;  // one per copy: the same descriptions, that copy's operands
      for (int j = 0; j < copies; ++j) ps.push_back(Describe(row, m, k, n, a[j], b[j]));
      const Problem& p = ps[0];
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
      // cuBLAS's own GEMM of copy j (the swap formulation: C^T[n, m] = B^T[n, k] A^T[k, m]).
      auto blas_run = [&](int j) {
        Check(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                           static_cast<int>(k), &alpha, b[j], CUDA_R_16BF, static_cast<int>(n),
                           a[j], CUDA_R_16BF, static_cast<int>(k), &beta, c, CUDA_R_16BF,
                           static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
      };
      // The median of 3 rounds of `runs` runs back to back: ms a run.
      auto loop_ms = [&](const std::function<void()>& one) {
        std::vector<float> per_run;
        for (int round = 0; round < 3; ++round) {
          Check(cudaEventRecord(begin, stream), "record");
          for (int r = 0; r < runs; ++r) one();
          Check(cudaEventRecord(end, stream), "record");
          Check(cudaEventSynchronize(end), "sync");
          float ms = 0;
          Check(cudaEventElapsedTime(&ms, begin, end), "elapsed");
          per_run.push_back(ms / runs);
        }
        std::sort(per_run.begin(), per_run.end());
        return per_run[1];
      };
      float best = 1e30f;
      int best_i = -1;
      std::vector<float> timed_ms(found, 1.0f);  // each candidate's sequential time
      for (int i = 0; i < found; ++i) {
        auto run = [&] {
          const Problem& q = ps[turn++ % copies];
          return cublasLtMatmul(handle, q.desc, &alpha, q.first_ptr, q.first, q.second_ptr,
                                q.second, &beta, c, q.out, c, q.out, &results[i].algo, ws, ws_bytes,
                                stream);
        };
        if (run() != CUBLAS_STATUS_SUCCESS) {
          std::printf("%s #%2d: cannot run\n", name, i);
          timed_ms[i] = -1.0f;  // left out of the windows
          continue;
        }
        const float med = loop_ms([&] { Check(run(), "matmul"); });
        timed_ms[i] = med;
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
      float blas_ms = 0;
      if (!row) {  // cuBLAS's own, timed as each candidate was
        blas_run(turn++ % copies);
        blas_ms = loop_ms([&] { blas_run(turn++ % copies); });
        std::printf("cuBLAS's own (cublasGemmEx): %8.4f ms %6.1f TFLOP/s\n", blas_ms,
                    tflop / (blas_ms * 1e-3));
      }
      if (!windows.empty()) {
        std::vector<int> runnable;  // the candidates' places in `results`
        std::vector<float> est;
        std::vector<int> tiles;
        for (int i = 0; i < found; ++i) {
          if (timed_ms[i] < 0) continue;
          runnable.push_back(i);
          est.push_back(timed_ms[i]);
          tiles.push_back(jax_ub::AlgoConfig(results[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
        }
        est.push_back(blas_ms);  // cuBLAS's own, last (tile -1)
        tiles.push_back(-1);
        TimeWindows(windows, rounds, est, tiles, stream, [&](int i) {
          if (i == static_cast<int>(runnable.size())) return blas_run(turn++ % copies);
          const Problem& q = ps[turn++ % copies];
          Check(cublasLtMatmul(handle, q.desc, &alpha, q.first_ptr, q.first, q.second_ptr, q.second,
                               &beta, c, q.out, c, q.out, &results[runnable[i]].algo, ws, ws_bytes,
                               stream),
                "matmul");
        });
      }
      for (Problem& q : ps) {
        cublasLtMatrixLayoutDestroy(q.first);
        cublasLtMatrixLayoutDestroy(q.second);
        cublasLtMatrixLayoutDestroy(q.out);
        cublasLtMatmulDescDestroy(q.desc);
      }
    }
    for (int j = 0; j < copies; ++j) {
      Check(cudaFree(a[j]), "free");
      Check(cudaFree(b[j]), "free");
    }
    Check(cudaFree(c), "free");
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cublasDestroy(blas);
  cudaStreamDestroy(stream);
  cudaFree(ws);
  cudaFree(blas_ws);
  cublasLtDestroy(handle);
  return 0;
}
