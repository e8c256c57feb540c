// The sleep tags of one DevicePool (sleep_tags.hpp): creation, routing, sleep and wake.
#include "sleep_tags.hpp"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda/capture.hpp"
#include "pool_options.hpp"
#include "vram/cuda/error.hpp"
#include "vram/pinned_host_upstream.hpp"

namespace vram::detail {
namespace {

std::string quoted(const std::string& name) { return "'" + name + "'"; }

// After a failed copy: waits for the copies queued before it (a failure to wait leaves a
// device that runs nothing more).
void wait_quietly(SleepCopier& copies) noexcept {
  try {
    (void)copies.wait();
  } catch (...) {
  }
}

// Walks the calling thread's stack, unlinking (and releasing) the entries no longer open;
// returns the first open entry naming the pool with uid `pool_uid`, null when none does (a
// pool uid is never 0: 0 walks the whole stack).
TagScopeEntry* walk_tag_scopes(std::uint64_t pool_uid) noexcept {
  TagScopeEntry** link = &tl_tag_scopes;
  while (TagScopeEntry* entry = *link) {
    if (!entry->open.load(std::memory_order_acquire)) {  // ended, maybe on another thread
      *link = entry->below;
      entry->release();
    } else if (entry->pool_uid == pool_uid) {
      return entry;
    } else {
      link = &entry->below;
    }
  }
  return nullptr;
}
void prune_tag_scopes() noexcept { (void)walk_tag_scopes(0); }

// Releases the stack's references at thread exit (scopes still open elsewhere keep theirs).
struct TagScopeStackRelease {
  bool armed = false;
  ~TagScopeStackRelease() {
    TagScopeEntry* entry = tl_tag_scopes;
    tl_tag_scopes = nullptr;
    while (entry != nullptr) {
      TagScopeEntry* below = entry->below;
      entry->release();
      entry = below;
    }
  }
};
thread_local TagScopeStackRelease tl_tag_scope_release;

}  // namespace

TagScopeEntry* open_tag_scope(std::uint64_t pool_uid, std::uint32_t index) {
  auto* entry = new TagScopeEntry(pool_uid, index);
  tl_tag_scope_release.armed = true;  // registers the thread-exit release
  prune_tag_scopes();
  entry->below = tl_tag_scopes;
  tl_tag_scopes = entry;
  return entry;
}

void end_tag_scope(TagScopeEntry* entry) noexcept {
  entry->open.store(false, std::memory_order_release);
  prune_tag_scopes();  // unlinks it here if this thread opened it
  entry->release();
}

Tag* SleepTags::scoped_tag() const noexcept {
  const TagScopeEntry* entry = walk_tag_scopes(pool_uid_);
  return entry == nullptr ? nullptr : tags_[entry->index - 1].load(std::memory_order_acquire);
}

Tag::Tag(std::string name_in, const SleepTagOptions& options_in, VirtualMemory& memory,
         ReservedGauge& gauge, std::size_t reservation_bytes, std::size_t max_run_bytes,
         std::shared_ptr<Upstream> backup_upstream)
    : name(std::move(name_in)),
      options(options_in),
      arena(memory, gauge, reservation_bytes, options_in.map_ahead_bytes, max_run_bytes),
      backup(std::move(backup_upstream), options_in.backup_chunk_bytes) {}

SleepTags::~SleepTags() {
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) delete tags_[i].load(std::memory_order_relaxed);
}

SleepTag SleepTags::create(std::string_view name, const SleepTagOptions& options,
                           const std::shared_ptr<VirtualMemory>& memory,
                           std::size_t reservation_bytes, std::size_t max_run_bytes,
                           MemoryKind pool_kind) {
  if (!memory) {
    throw InvalidArgument(
        "vram::DevicePool::create_tag: the pool's large tier does not run over virtual memory, "
        "so a tag's memory could not be unmapped with its addresses kept. Fix: "
        "Options{.large_tier = {.memory = vram::LargeTierMemory::virtual_memory}} (CUDA "
        "virtual memory management, or the host emulation over a host upstream).");
  }
  if (name.empty()) {
    throw InvalidArgument("vram::DevicePool::create_tag: the name is empty. Fix: name the tag.");
  }
  // Checked before anything is taken: a refused tag uses no slot and no name. The bound keeps
  // TagArena's rounding and per-granule bookkeeping finite (tag_arena.hpp).
  if (options.reservation_bytes > kMaxReservationBytes) {
    throw InvalidArgument("vram::DevicePool::create_tag: SleepTagOptions::reservation_bytes " +
                          std::to_string(options.reservation_bytes) + " is above the " +
                          std::to_string(kMaxReservationBytes >> 40) +
                          " TiB of address space one range of a pool can span. Fix: 0 reserves "
                          "as much as the pool's large tier; else at most the tag's peak bytes "
                          "with some room.");
  }
  std::lock_guard lock(create_mutex_);
  if (find(name)) {
    throw InvalidArgument("vram::DevicePool::create_tag: a tag " + quoted(std::string(name)) +
                          " exists already. Fix: find_tag() returns it.");
  }
  const std::uint32_t n = count_.load(std::memory_order_relaxed);
  if (n == kMaxTags) {
    throw InvalidArgument("vram::DevicePool::create_tag: a pool has at most 64 tags.");
  }
  std::shared_ptr<Upstream> backup = options.backup;
  if (!backup) {
    if (pool_kind == MemoryKind::device) {
      backup = std::make_shared<PinnedHostUpstream>();
    } else {
      backup = std::make_shared<HostMemoryUpstream>();
    }
  }
  if (!memory_) {  // every tag maps through the first one's (it lives as long as they do)
    memory_ = memory;
    const auto* cuda_memory = dynamic_cast<const CudaVirtualMemory*>(memory.get());
    device_ = cuda_memory != nullptr ? cuda_memory->device() : -1;
  }
  const std::size_t reservation =
      options.reservation_bytes != 0 ? options.reservation_bytes : reservation_bytes;
  auto tag = std::make_unique<Tag>(std::string(name), options, *memory_, gauge_, reservation,
                                   max_run_bytes, std::move(backup));
  activity_.add(1);  // every call asks the tags from now on
  tags_[n].store(tag.release(), std::memory_order_release);
  count_.store(n + 1, std::memory_order_release);
  return {pool_uid_, n + 1};
}

std::optional<SleepTag> SleepTags::find(std::string_view name) const noexcept {
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    if (tags_[i].load(std::memory_order_acquire)->name == name) return SleepTag{pool_uid_, i + 1};
  }
  return std::nullopt;
}

std::vector<SleepTag> SleepTags::all() const {
  std::vector<SleepTag> out;
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) out.push_back({pool_uid_, i + 1});
  return out;
}

Tag& SleepTags::tag_of(SleepTag tag, const char* call) const {
  if (tag.pool != pool_uid_ || tag.index == 0 ||
      tag.index > count_.load(std::memory_order_acquire)) {
    throw InvalidArgument(std::string("vram::DevicePool::") + call +
                          ": no such tag in this pool (never created here, or another pool's). "
                          "Fix: use a SleepTag that this pool's create_tag() or find_tag() "
                          "returned.");
  }
  return *tags_[tag.index - 1].load(std::memory_order_acquire);
}

Tag* SleepTags::owner_of(const void* block) const noexcept {
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    Tag* tag = tags_[i].load(std::memory_order_acquire);
    if (tag->arena.contains(block)) return tag;
  }
  return nullptr;
}

void* SleepTags::allocate(Tag& tag, std::size_t bytes, StreamKey key) {
  std::lock_guard lock(tag.mutex);
  if (tag.state == SleepState::asleep || tag.closed) {
    throw InvalidArgument("vram::DevicePool::allocate: the tag " + quoted(tag.name) +
                          " is asleep. Fix: wake() it before allocating into it.");
  }
  if (device_ < 0) return tag.arena.allocate(TagArena::round(bytes), key);
  const cuda::RelaxedCaptureMode relaxed;
  return tag.arena.allocate(TagArena::round(bytes), key);
}

bool SleepTags::asleep(Tag& tag) noexcept {
  std::lock_guard lock(tag.mutex);
  return tag.state == SleepState::asleep;
}

bool SleepTags::is_live(Tag& tag, const void* block, std::size_t bytes) noexcept {
  std::lock_guard lock(tag.mutex);
  const std::size_t block_bytes = tag.arena.block_bytes_of(block);
  return block_bytes != 0 && block_bytes == TagArena::round(bytes);
}

SleepTags::Release SleepTags::free(Tag& tag, void* block, std::size_t bytes, StreamKey key,
                                   std::size_t& block_bytes) noexcept {
  std::lock_guard lock(tag.mutex);
  block_bytes = tag.arena.block_bytes_of(block);
  if (block_bytes == 0 || block_bytes != TagArena::round(bytes)) return Release::not_live;
  if (tag.state == SleepState::asleep && !tag.closed) return Release::asleep;
  tag.arena.free(block, key);
  return Release::taken;
}

std::unique_ptr<SleepCopier> SleepTags::copier(cudaStream_t stream) {
  if (device_ < 0) return SleepCopier::for_host();
  std::lock_guard lock(stream_mutex_);
  return SleepCopier::for_device(device_, stream, own_stream_);
}

void SleepTags::sleep(Tag& tag, cudaStream_t stream, SleepContents contents) {
  std::lock_guard lock(tag.mutex);
  if (tag.state == SleepState::asleep) {
    throw InvalidArgument("vram::DevicePool::sleep: the tag " + quoted(tag.name) +
                          " is asleep already. Fix: wake() it first.");
  }
  // Everything that can fail comes before the first unmap, but the waits of later batches:
  // on failure the tag stays awake, its contents where they were (restore_released).
  std::vector<Tag::Saved> saved;
  std::size_t total = 0;
  if (!tag.options.discardable && contents == SleepContents::keep) {
    for (const TagArena::Range& range : tag.arena.live_ranges(kMaxCopyGap)) {
      saved.push_back({range.offset, range.bytes, total});
      total += range.bytes;
    }
    tag.backup.ensure(total);
  }
  // A batch of copies per run that holds live bytes, on one stream: each run is released as
  // soon as the batch of its last live byte is proven, while the later batches still copy
  // (the driver's work after a release overlaps them instead of a wake that follows). Batch
  // i proves every live byte below below[i]; the last one proves the rest (and, with nothing
  // to copy, the work queued before the sleep).
  std::vector<std::unique_ptr<SleepCopier>> batches;
  // Destroyed last to first: the first copier's device guard outlives the others.
  struct LastFirst {
    std::vector<std::unique_ptr<SleepCopier>>& batches;
    ~LastFirst() {
      while (!batches.empty()) batches.pop_back();
    }
  } last_first{batches};
  std::vector<std::size_t> below;
  auto wait_all_quietly = [&]() noexcept {
    for (const auto& batch : batches) wait_quietly(*batch);
  };
  try {
    batches.push_back(copier(stream));
    const std::vector<std::size_t> run_ends = tag.arena.run_ends();
    std::size_t next_end = 0;  // the first run end above the bytes queued so far
    bool queued = false;       // the open batch holds copies
    char* base = tag.arena.base();
    auto queue = [&](std::byte* host, std::size_t offset, std::size_t bytes) {
      while (bytes != 0) {
        if (next_end < run_ends.size() && run_ends[next_end] <= offset) {
          while (next_end < run_ends.size() && run_ends[next_end] <= offset) ++next_end;
          if (queued) {  // every live byte below `offset` is queued: close the batch
            batches.back()->seal();
            below.push_back(offset);
            batches.push_back(copier(batches.back()->stream()));
            queued = false;
          }
        }
        const std::size_t n =
            next_end < run_ends.size() ? std::min(bytes, run_ends[next_end] - offset) : bytes;
        batches.back()->to_host(host, base + offset, n);
        queued = true;
        host += n;
        offset += n;
        bytes -= n;
      }
    };
    for (const Tag::Saved& range : saved) {
      tag.backup.for_each_piece(range.backup_offset, range.bytes,
                                [&](std::byte* host, std::size_t done, std::size_t n) {
                                  queue(host, range.offset + done, n);
                                });
    }
    batches.back()->seal();
  } catch (...) {
    wait_all_quietly();  // the copies queued so far end before the backup is reused
    throw;
  }
  // Relaxed: a global-mode capture another thread begins between two batches does not
  // refuse the waits.
  std::optional<cuda::RelaxedCaptureMode> relaxed;
  if (device_ >= 0) relaxed.emplace();
  std::size_t released = 0;  // every run that ends at or below it is unmapped
  for (std::size_t i = 0; i < batches.size(); ++i) {
    try {
      const CopiesCompleted proof = batches[i]->wait();
      batches[i]->check(proof);  // a witness of another batch proves nothing: unmap nothing
    } catch (...) {
      wait_all_quietly();
      if (released != 0) restore_released(tag, saved, released, batches.front()->stream());
      throw;
    }
    if (i < below.size()) {
      tag.arena.unmap_below(below[i]);
      released = below[i];
    } else {
      tag.arena.unmap_all();
    }
  }
  tag.arena.untag_free();  // no stream's work uses the range any more
  tag.copied_ranges = saved.size();
  tag.saved = std::move(saved);
  tag.backed_up_bytes = total;
  tag.state = SleepState::asleep;
  ++tag.sleeps;
}

void SleepTags::restore_released(Tag& tag, const std::vector<Tag::Saved>& saved,
                                 std::size_t released, cudaStream_t stream) noexcept {
  // The released runs' live bytes are proven in the backup: mapped again and copied back,
  // the tag is awake and intact. The runs above `released` were never unmapped.
  try {
    std::unique_ptr<SleepCopier> copies = copier(stream);
    try {
      tag.arena.map_live([](std::size_t) {});
      for (const Tag::Saved& range : saved) {
        if (range.offset >= released) break;
        copy_back(tag, *copies, range, 0, std::min(range.bytes, released - range.offset));
      }
      copies->check(copies->wait());
      return;
    } catch (...) {
      wait_quietly(*copies);
      throw;
    }
  } catch (...) {
  }
  std::fprintf(stderr,
               "vram::DevicePool::sleep: the device failed while the tag '%s' was put to sleep "
               "and its released runs could not be mapped and copied back: the contents of its "
               "blocks below byte %zu of its range are lost.\n",
               tag.name.c_str(), released);
}

void SleepTags::copy_back(Tag& tag, SleepCopier& copies, const Tag::Saved& range, std::size_t from,
                          std::size_t to) {
  char* const at = tag.arena.base() + range.offset + from;
  tag.backup.for_each_piece(range.backup_offset + from, to - from,
                            [&](std::byte* host, std::size_t done, std::size_t n) {
                              copies.to_device(at + done, host, n);
                            });
}

void SleepTags::wake(Tag& tag, cudaStream_t stream) {
  std::lock_guard lock(tag.mutex);
  if (tag.state != SleepState::asleep) {
    throw InvalidArgument("vram::DevicePool::wake: the tag " + quoted(tag.name) +
                          " is awake (wake without sleep). Fix: call wake() only after sleep().");
  }
  // Each run's copies are queued as soon as it is mapped: the copies of one run overlap the
  // mapping of the next. The saved ranges are in address order, as the runs are mapped.
  std::unique_ptr<SleepCopier> copies;
  try {
    copies = copier(stream);
    std::size_t next = 0;    // the first saved range not wholly queued
    std::size_t queued = 0;  // its bytes queued
    tag.arena.map_live([&](std::size_t mapped_end) {
      for (; next < tag.saved.size(); ++next, queued = 0) {
        const Tag::Saved& range = tag.saved[next];
        const std::size_t stop =
            std::min(range.bytes, mapped_end - std::min(mapped_end, range.offset));
        if (stop > queued) {
          copy_back(tag, *copies, range, queued, stop);
          queued = stop;
        }
        if (queued < range.bytes) return;  // the rest lies in runs not mapped yet
      }
    });
    if (next != tag.saved.size()) {
      throw std::logic_error(
          "vram::DevicePool::wake: a saved range lies outside the live granules");
    }
    const CopiesCompleted proof = copies->wait();  // the backup is reusable from here on
    copies->check(proof);
  } catch (...) {
    if (copies) wait_quietly(*copies);  // no copy still writes what is unmapped next
    tag.arena.unmap_all();              // asleep again, the backup intact
    throw;
  }
  tag.saved.clear();
  tag.state = SleepState::awake;
  ++tag.wakes;
}

SleepTagStats SleepTags::stats(Tag& tag) const {
  std::lock_guard lock(tag.mutex);
  SleepTagStats s;
  s.name = tag.name;
  s.state = tag.state;
  s.discardable = tag.options.discardable;
  s.live_blocks = tag.arena.live_blocks();
  s.live_bytes = tag.arena.live_bytes();
  s.mapped_bytes = tag.arena.mapped_bytes();
  s.backup_bytes = tag.backup.capacity();
  s.backed_up_bytes = tag.backed_up_bytes;
  s.copies = tag.copied_ranges;
  s.sleeps = tag.sleeps;
  s.wakes = tag.wakes;
  s.base = tag.arena.base();
  s.reservation_bytes = tag.arena.reservation_bytes();
  return s;
}

SleepTags::Totals SleepTags::totals() const noexcept {
  Totals totals;
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    Tag* tag = tags_[i].load(std::memory_order_acquire);
    std::lock_guard lock(tag->mutex);
    totals.mapped_bytes += tag->arena.mapped_bytes();
    totals.sleeping += tag->state == SleepState::asleep ? 1 : 0;
  }
  return totals;
}

void SleepTags::trim() noexcept {
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    Tag* tag = tags_[i].load(std::memory_order_acquire);
    std::lock_guard lock(tag->mutex);
    if (tag->state == SleepState::awake) tag->arena.unmap_free_runs();
  }
}

void SleepTags::close() noexcept {
  const std::uint32_t n = count_.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    Tag* tag = tags_[i].load(std::memory_order_acquire);
    std::lock_guard lock(tag->mutex);
    tag->closed = true;
    if (tag->state == SleepState::asleep) {
      std::fprintf(stderr,
                   "vram::DevicePool destroyed while the tag '%s' sleeps: its %zu backed-up "
                   "bytes are dropped; its address range goes with its last block.\n",
                   tag->name.c_str(), tag->backed_up_bytes);
      tag->backup.release();
      tag->saved.clear();
    }
  }
}

}  // namespace vram::detail
