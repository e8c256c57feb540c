// src/device_pool/tag_backup.hpp: the host memory a sleep tag's contents wait in while it
// sleeps: pinned chunks, pinned once and reused by every later sleep.
//
// The chunks form one space of capacity() bytes (chunk after chunk); a sleep lays the
// tag's live ranges out in it back to back. Rule: a chunk is written by a sleep's copies
// only after the previous wake's copies out of it were observed complete (wake returns
// after that proof), and read by a wake only after the sleep's copies into it were.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "vram/upstream.hpp"

namespace vram::detail {

class TagBackup {
 public:
  TagBackup(std::shared_ptr<Upstream> upstream, std::size_t chunk_bytes);
  ~TagBackup() { release(); }
  TagBackup(const TagBackup&) = delete;
  TagBackup& operator=(const TagBackup&) = delete;

  // Pins chunks until capacity() >= bytes. Throws what the upstream throws (the chunks
  // pinned before stay).
  void ensure(std::size_t bytes);
  std::size_t capacity() const noexcept { return capacity_; }
  // Calls piece(host, done, n) for the pieces of [offset, offset + bytes) of the space:
  // host memory of `n` bytes holding bytes [done, done + n) of the range.
  template <class Piece>
  void for_each_piece(std::size_t offset, std::size_t bytes, Piece&& piece) const {
    std::size_t done = 0;
    std::size_t start = 0;  // of the chunk in the space
    for (const Chunk& chunk : chunks_) {
      if (done == bytes) return;
      const std::size_t end = start + chunk.bytes;
      const std::size_t at = offset + done;
      if (at < end) {
        const std::size_t n = std::min(bytes - done, end - at);
        piece(static_cast<std::byte*>(chunk.data) + (at - start), done, n);
        done += n;
      }
      start = end;
    }
  }
  void release() noexcept;

 private:
  struct Chunk {
    void* data;
    std::size_t bytes;
  };
  std::shared_ptr<Upstream> upstream_;
  std::size_t chunk_bytes_;
  std::vector<Chunk> chunks_;
  std::size_t capacity_ = 0;
};

}  // namespace vram::detail
