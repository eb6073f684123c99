// The CPU handlers' per-call state: XLA instantiates it once for every custom call it
// compiled, so copies of one call site (a jitted function called from several places,
// whose body XLA copies into each) get keys of their own.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_ub {

namespace ffi = xla::ffi;

struct CallCopy {
  static ffi::TypeId id;  // set when Python registers the type (_host.call_copy_type)
  static const ffi::TypeInfo info;
  uint64_t key = 0;  // the site, mixed with the copy's number among its site's copies
};

// Forget the copy counts (jax_ub.finalize); programs compiled later count from 0 again.
void ResetCallCopies();

}  // namespace jax_ub
