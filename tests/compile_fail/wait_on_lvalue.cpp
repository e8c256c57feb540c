// Must not compile: wait() consumes the PendingCopy (one copy, one witness), so it can only
// be called on an rvalue.
#include "vram/copy.hpp"

vram::CopyCompleted misuse(vram::PendingCopy& copy) {
#ifdef VRAM_CONTROL
  return std::move(copy).wait();
#else
  return copy.wait();
#endif
}
