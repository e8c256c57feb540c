// Completion fences for host-only tests of PendingWork and the copy witness.
#pragma once

#include <atomic>
#include <memory>

namespace vram::testing {

// Never fires on its own and fires when waited, counting the waits: a test sees whether
// something waited for it (and does not hang when something does).
struct FiresWhenWaited {
  std::shared_ptr<std::atomic<int>> waits = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<bool>> fired = std::make_shared<std::atomic<bool>>(false);
  bool ready() const { return fired->load(); }
  void wait() {
    waits->fetch_add(1);
    fired->store(true);
  }
};

}  // namespace vram::testing
