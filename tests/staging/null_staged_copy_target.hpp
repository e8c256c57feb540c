// A StagedCopyTarget whose copies are complete at once: the pageable stager's misuse tests
// (its threads, its options) build stagers over it.
#pragma once

#include <cstddef>

#include "staging/pageable_stager.hpp"
#include "vram/copy.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/testing/witness.hpp"

namespace vram::testing {

class NullTarget final : public detail::StagedCopyTarget {
 public:
  void bind_thread() override {}
  void begin(const detail::StagerJob&) override {}
  PendingCopy copy(std::byte*, PooledStaging& staging) override {
    struct Done {
      bool ready() const { return true; }
      void wait() {}
    };
    return WitnessMint::host_copy(staging, Done{});
  }
  void end(const detail::StagerJob&) override {}
};

}  // namespace vram::testing
