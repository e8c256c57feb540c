// vram/sleep_tag.hpp: tagged memory of a DevicePool that can sleep (its physical memory
// given back, its addresses kept) and wake (mapped again at the same addresses, contents
// copied back).
//
//   vram::DevicePool pool(0, {.large_tier = {.memory = vram::LargeTierMemory::virtual_memory}});
//   vram::SleepTag weights = pool.create_tag("weights");
//   vram::SleepTag kv = pool.create_tag("kv", {.discardable = true});
//   {
//     auto scope = pool.tag_scope(weights);   // this thread's allocations go to "weights"
//     load_model(pool);
//   }
//   pool.sleep(weights, stream);              // copied to pinned host memory, unmapped
//   pool.sleep(kv, stream);                   // unmapped, nothing copied
//   ... the GPU memory is free for other work ...
//   pool.wake(weights, stream);               // mapped at the same addresses, copied back
//   pool.wake(kv, stream);                    // mapped; contents uninitialised
//   pool.sleep(weights, stream, vram::SleepContents::discard);  // unmapped, nothing copied
//   pool.wake(weights, stream);               // mapped; contents uninitialised (reload them)
//
// Where a tag's memory comes from
//   Each tag owns its own reserved address range of the pool's virtual memory: every
//   tagged request (any size, rounded to 512 bytes) is carved best-fit out of it and the
//   2 MiB granules under it are mapped for the tag alone, so sleep can unmap exactly the
//   tag's memory. A pool without virtual memory cannot create tags (vram::InvalidArgument).
//   A tag's free granules stay mapped until trim() or sleep; wake maps only the granules
//   under live blocks.
//
// Ordering
//   sleep(tag, stream): the copies to host memory are queued on `stream` after the work
//   queued on it before the call; work on other streams that uses the tag's blocks must be
//   ordered before it by the caller (an event the stream waits on). stream == nullptr:
//   the device is synchronized first and the copies run on a stream of the pool's own.
//   Either way sleep returns only after the host observed the end of every copy. The
//   copies are queued in one batch per mapped run that holds live bytes (a run is at most
//   Options::large_tier.virtual_run_bytes), each batch ending in an event; a run is unmapped
//   and its physical memory released only once the host observed the event of the batch
//   that copies its last live byte, while later batches still copy. With nothing to copy
//   (a discardable tag, SleepContents::discard, no live block) the sleep waits for one event
//   queued on `stream`. If a wait fails after runs were released, they are mapped again and
//   their bytes copied back from the backup, and the error is thrown with the tag awake and
//   intact; only a device that cannot do that either loses them (said on stderr).
//   wake(tag, stream): maps, queues the copies back on `stream` (or the pool's own), and
//   returns after they completed: work queued on any stream afterwards sees the contents.
//
// Reuse of the backup
//   The pinned host buffers of a tag are pinned at its first sleep (in chunks of
//   SleepTagOptions::backup_chunk_bytes) and kept for later cycles; more are pinned only
//   when the tag's live bytes grew. They are freed with the pool.
//
// Misuse (each leaves the tag as it was, nothing lost)
//   sleep of a sleeping tag, wake of an awake one, a tag of another pool or never created:
//   vram::InvalidArgument. A request into a sleeping tag: vram::InvalidArgument. A release
//   of a sleeping tag's block: refused, said on stderr and counted in invalid_deallocations; the
//   block stays live and is restored at wake. Host memory for the backup exhausted:
//   vram::PinningError or vram::OutOfMemory from the pin; the tag stays awake and intact.
//   Device memory exhausted at wake: vram::OutOfMemory; the tag stays asleep, its backup
//   intact, and wake may be called again. Destroying the pool while a tag sleeps (noexcept):
//   the backup is freed at once and a warning names the tag; its live blocks stay counted as
//   leased (their releases are accepted) and the address range goes with the last of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "vram/upstream.hpp"

namespace vram {

struct SleepTagOptions {
  // Released without a copy at sleep; back uninitialised at wake (a KV cache).
  bool discardable = false;
  // The tag's own address range; 0: as large as the pool's large tier reserves. Above
  // 16 TiB (the large tier's own limit) create_tag throws vram::InvalidArgument.
  std::size_t reservation_bytes = 0;
  // Where the backup is pinned; null: PinnedHostUpstream over a device, the pool's kind
  // of host memory over the host emulation.
  std::shared_ptr<Upstream> backup = nullptr;
  std::size_t backup_chunk_bytes = std::size_t{256} << 20;
  // Granules mapped ahead of a block that needs new ones (fewer maps while a model loads).
  std::size_t map_ahead_bytes = std::size_t{64} << 20;
};

// A tag of one DevicePool: a value handle (copyable); 0 names no tag.
struct SleepTag {
  std::uint64_t pool = 0;  // the uid of the pool that created it
  std::uint32_t index = 0;
  explicit operator bool() const noexcept { return index != 0; }
  friend bool operator==(const SleepTag&, const SleepTag&) = default;
};

enum class SleepState : std::uint8_t { awake, asleep };

// What sleep does with a tag's contents.
enum class SleepContents : std::uint8_t {
  keep,     // copied to the backup and back at wake (a discardable tag: dropped)
  discard,  // dropped, backup or not: nothing is copied either way and the memory mapped at
            // wake is uninitialised (vLLM's sleep level 2); a backup already pinned is kept
            // for a later sleep that keeps
};

struct SleepTagStats {
  std::string name;
  SleepState state = SleepState::awake;
  bool discardable = false;
  std::size_t live_blocks = 0;
  std::size_t live_bytes = 0;       // block bytes of live blocks
  std::size_t mapped_bytes = 0;     // physical bytes mapped now (0 while asleep)
  std::size_t backup_bytes = 0;     // pinned host bytes held for the backup
  std::size_t backed_up_bytes = 0;  // bytes copied at the last sleep
  std::size_t copies = 0;  // ranges copied at the last sleep (neighbouring blocks coalesced)
  std::uint64_t sleeps = 0;
  std::uint64_t wakes = 0;
  char* base = nullptr;  // the tag's reserved address range
  std::size_t reservation_bytes = 0;
};

}  // namespace vram
