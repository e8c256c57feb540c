// A sleep tag's pinned backup (tag_backup.hpp).
#include "tag_backup.hpp"

#include <algorithm>

#include "vram/cuda/error.hpp"

namespace vram::detail {

TagBackup::TagBackup(std::shared_ptr<Upstream> upstream, std::size_t chunk_bytes)
    : upstream_(std::move(upstream)),
      chunk_bytes_(std::max<std::size_t>(chunk_bytes, std::size_t{2} << 20)) {}

void TagBackup::ensure(std::size_t bytes) {
  while (capacity_ < bytes) {
    constexpr std::size_t kPage = 4096;
    const std::size_t need = (bytes - capacity_ + kPage - 1) / kPage * kPage;
    const std::size_t n = std::min(chunk_bytes_, need);
    chunks_.reserve(chunks_.size() + 1);
    void* data = allocate_non_null(*upstream_, n);
    chunks_.push_back({data, n});
    capacity_ += n;
  }
}

void TagBackup::release() noexcept {
  for (const Chunk& chunk : chunks_) upstream_->deallocate(chunk.data, chunk.bytes);
  chunks_.clear();
  capacity_ = 0;
}

}  // namespace vram::detail
