// solo_merge.h: solo_schedule.cu's `merged` reduce-scatter, fewer and larger GEMMs than the
// library's step list has (a probe of what bigger chunks would gain). Not part of the library.
#pragma once

#include <cstdint>
#include <vector>

#include "protocol/dtype.h"
#include "protocol/schedule.h"

namespace solo {

// `steps` with each run of GEMMs over consecutive row blocks merged into one GEMM, until it has
// at least `min_rows` rows: a GEMM joins the one before it on its lane where its input and
// destination continue that GEMM's, neither adds an addend or an epilogue, and no wait on
// their lane lies between (a merged GEMM must not start before what it waited for).
inline std::vector<jax_ub::Step> MergeGemms(std::vector<jax_ub::Step> steps,
                                            const jax_ub::CallShape& s, int64_t min_rows) {
  using jax_ub::Step;
  auto plain = [](const Step& g) {
    return g.kind == Step::Kind::kGemm && !g.epilogue && g.addend.region == jax_ub::Region::kNone;
  };
  auto follows = [](const jax_ub::Ref& a, const jax_ub::Ref& b, int64_t bytes) {
    return a.region == b.region && a.peer == b.peer && b.offset == a.offset + bytes;
  };
  const int64_t in_es = jax_ub::DTypeSize(s.in), out_es = jax_ub::DTypeSize(s.out);
  std::vector<Step> out;
  int open = -1;  // the GEMM in `out` that later ones may join
  for (const Step& st : steps) {
    if (st.kind == Step::Kind::kWait && open >= 0 && st.lane == out[open].lane) open = -1;
    if (st.kind != Step::Kind::kGemm) {
      out.push_back(st);
      continue;
    }
    Step* g = open >= 0 ? &out[open] : nullptr;
    if (g != nullptr && plain(*g) && plain(st) && g->lane == st.lane && g->rows < min_rows &&
        follows(g->src, st.src, g->rows * s.k * in_es) &&
        follows(g->dst, st.dst, g->rows * s.n * out_es)) {
      g->rows += st.rows;
      continue;
    }
    out.push_back(st);
    open = static_cast<int>(out.size()) - 1;
  }
  return out;
}

}  // namespace solo
