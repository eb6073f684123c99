// Kernel choices kept across processes: a text file with one line per tuned GEMM, so a
// later process (or another GPU of the same kind) runs the kernel an earlier one chose,
// without tuning or trials (jax_ub's `gemm_cache` setting). A choice is the description
// (row or column) and the kernel's place in cuBLASLt's heuristic list for it, which is the
// same list in every process of one cuBLASLt version and GPU model (the key names both),
// as XLA's autotuner keeps its pick; cuBLASLt's algorithm structure is opaque, not kept.
#pragma once

#include <string>
#include <utility>

#include "protocol/status.h"

namespace jax_ub {

class GemmChoiceFile {
 public:
  explicit GemmChoiceFile(std::string path = "") : path_(std::move(path)) {}
  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  // The first choice the file holds for `key` (text naming the GPU, cuBLASLt's version and
  // the GEMM; no '|' or newline). Read anew each time: other processes may have added
  // lines since. A missing file or a line that does not parse is no choice.
  bool Find(const std::string& key, bool* row, int* index) const;

  // Appends `key`'s choice as one line in one write to a file opened for appending, so
  // lines of processes writing at once do not interleave (on a local file system).
  Status Record(const std::string& key, bool row, int index) const;

 private:
  std::string path_;
};

}  // namespace jax_ub
