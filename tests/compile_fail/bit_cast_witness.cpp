// Must not compile: a witness is not trivially copyable, so std::bit_cast cannot duplicate
// one (one completed copy must not retire a buffer twice).
#include <bit>

#include "vram/copy.hpp"

void misuse(vram::PendingCopy copy) {
  vram::CopyCompleted witness = std::move(copy).wait();
#ifdef VRAM_CONTROL
  vram::CopyCompleted twin = std::move(witness);
#else
  vram::CopyCompleted twin = std::bit_cast<vram::CopyCompleted>(witness);
#endif
  (void)twin;
}
