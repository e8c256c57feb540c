#include "stream_identity.hpp"

#include "status.hpp"

namespace vram::cuda {

std::uint64_t stream_id(cudaStream_t stream) noexcept {
  unsigned long long id = 0;
  if (!succeeded(cudaStreamGetId(stream, &id))) return 0;
  return id;
}

}  // namespace vram::cuda
