// The kernel choice file (choice_file.h). A line:
//   <key> | <row: 0 or 1> <index in cuBLASLt's heuristic list>
#include "cuda/gemm/choice_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

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

}  // namespace jax_ub
