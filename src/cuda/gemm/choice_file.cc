// The kernel choice file (cuda_gemm_choices.h), and the GEMM wrapper's use of it: the
// keys it writes, plans made from a line, choices recorded. A line:
//   <key> | <row: 0 or 1> <index in cuBLASLt's heuristic list>
#include "cuda_gemm_choices.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda_gemm.h"
#include "cuda_gemm_internal.h"
#include "trace.h"

namespace jax_ub {

bool GemmChoiceFile::Find(const std::string& key, bool* row, int* index) const {
  if (!enabled()) return false;
  // Plain C I/O: parsing with iostreams (operator>> into an int) segfaulted inside the
  // Python process on the GPU machine.
  std::FILE* f = std::fopen(path_.c_str(), "r");
  if (f == nullptr) return false;  // no choices yet
  const std::string prefix = key + " | ";
  std::string line;
  bool found = false;
  for (int ch = 0; !found && ch != EOF;) {
    line.clear();
    while ((ch = std::fgetc(f)) != EOF && ch != '\n') line += static_cast<char>(ch);
    if (line.compare(0, prefix.size(), prefix) != 0) continue;
    // "<row> <index>" and nothing else; a damaged line is skipped.
    const char* rest = line.c_str() + prefix.size();
    char* end = nullptr;
    const long r = std::strtol(rest, &end, 10);
    if (end == rest || *end != ' ' || (r != 0 && r != 1)) continue;
    const char* idx = end + 1;
    const long i = std::strtol(idx, &end, 10);
    if (end == idx || *end != '\0' || i < 0 || i > 1000000) continue;
    *row = r == 1;
    *index = static_cast<int>(i);
    found = true;
  }
  std::fclose(f);
  return found;
}

Status GemmChoiceFile::Record(const std::string& key, bool row, int index) const {
  if (!enabled()) return Status::Ok();
  const std::string line = key + " | " + (row ? "1 " : "0 ") + std::to_string(index) + "\n";
  const int fd = open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    return Internal("cannot open the GEMM choice file " + path_ + ": " + std::strerror(errno));
  const ssize_t n = write(fd, line.data(), line.size());
  const int err = errno;
  close(fd);
  if (n != static_cast<ssize_t>(line.size()))
    return Internal("cannot write the GEMM choice file " + path_ + ": " +
                    (n < 0 ? std::strerror(err) : "short write"));
  return Status::Ok();
}

using namespace gemm_internal;  // NOLINT: the GEMM wrapper's own constants

std::string CublasLtGemm::ChoiceKey(const Key& key) const {
  if (!choices_.enabled()) return "";
  std::string gpu = gpu_name_;
  for (char& ch : gpu)
    if (ch == ' ' || ch == '|' || ch == '\n') ch = '_';
  const auto [types, m, k, n, b_transposed, epilogue_code] = key;
  char text[176];
  std::snprintf(text, sizeof(text), "v1 types=%d m=%lld k=%lld n=%lld bt=%d ep=%d tf32=%d fa=%d",
                types, static_cast<long long>(m), static_cast<long long>(k),
                static_cast<long long>(n), b_transposed ? 1 : 0, epilogue_code,
                options_.allow_tf32 ? 1 : 0, FastAccumulation(key) ? 1 : 0);
  return "gpu=" + gpu + " cublasLt=" + std::to_string(cublasLtGetVersion()) + " " + text;
}

Status CublasLtGemm::PlanFromChoices(const Key& key, const std::string& choice_key,
                                     const Epilogue& ep, const std::vector<bool>& rows,
                                     const void* a, const void* b, void* c, const GemmArgs& args,
                                     cudaStream_t stream, Plan** plan) {
  *plan = nullptr;
  bool row = false;
  int index = -1;
  if (!choices_.Find(choice_key, &row, &index)) return Status::Ok();
  if (std::find(rows.begin(), rows.end(), row) == rows.end()) return Status::Ok();
  Plan p;
  p.epilogue = ep;
  std::vector<cublasLtMatmulHeuristicResult_t> results;
  Status st = Describe(key, row, &p);
  // Tuning's candidates are the first kCandidates: a larger index is no choice of ours.
  if (st.ok() && index < kCandidates) st = Heuristic(p, kCandidates, &results);
  cublasLtMatmulAlgo_t algo{};
  const bool usable = st.ok() && index < static_cast<int>(results.size()) &&
                      results[index].state == CUBLAS_STATUS_SUCCESS;
  if (usable) algo = results[index].algo;
  GemmArgs no_addend = args;
  no_addend.addend = nullptr;
  // Run once, as tuning would have: its kernel is loaded before any peer wait (Prepare).
  if (usable) st = Run(p, algo, a, b, c, stream, no_addend);
  if (!usable || !st.ok()) {
    JAX_UB_TRACE("GPU %d GEMM m=%lld k=%lld n=%lld: the choice file's kernel is refused here (%s)",
                 device_, static_cast<long long>(std::get<1>(key)),
                 static_cast<long long>(std::get<2>(key)), static_cast<long long>(std::get<3>(key)),
                 st.ok() ? "no such candidate" : st.message().c_str());
    Destroy(p);
    return Status::Ok();  // tuned instead
  }
  p.algo = algo;
  std::tie(std::ignore, p.m, p.k, p.n, std::ignore, std::ignore) = key;
  p.choice_key = choice_key;
  p.choice_index = index;
  JAX_UB_TRACE("GPU %d GEMM m=%lld k=%lld n=%lld: %s description, tile %d, from the choice file",
               device_, static_cast<long long>(p.m), static_cast<long long>(p.k),
               static_cast<long long>(p.n), row ? "row" : "column",
               AlgoConfig(algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
  *plan = &plans_.emplace(key, std::move(p)).first->second;
  return Status::Ok();
}

void CublasLtGemm::RecordChoice(const Plan& p) {
  if (p.choice_key.empty()) return;
  const Status st = choices_.Record(p.choice_key, p.row, p.choice_index);
  if (!st.ok() && !choices_failed_) {
    choices_failed_ = true;
    std::fprintf(stderr, "jax_ub: %s; kernel choices are not kept for later processes\n",
                 st.message().c_str());
  }
}

}  // namespace jax_ub
