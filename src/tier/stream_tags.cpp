#include "stream_tags.hpp"

#include <algorithm>
#include <atomic>
#include <utility>

namespace vram::detail {

void StreamTags::release(std::uint64_t marker) noexcept {
  for (Kept& kept : kept_) {
    if (kept.marker == marker) {
      kept.released = true;  // the last holder releases it
      return;
    }
  }
  fence_.release(marker);
}

bool StreamTags::keep(std::uint64_t marker) noexcept {
  for (Kept& kept : kept_) {
    if (kept.marker == marker) {
      ++kept.holders;
      return true;
    }
  }
  try {
    kept_.push_back(Kept{marker, 1, false});
  } catch (...) {
    return false;
  }
  return true;
}

void StreamTags::unkeep(std::uint64_t marker) noexcept {
  for (std::size_t i = 0; i < kept_.size(); ++i) {
    if (kept_[i].marker != marker) continue;
    if (--kept_[i].holders == 0) {
      if (kept_[i].released) fence_.release(marker);
      kept_[i] = kept_.back();
      kept_.pop_back();
    }
    return;
  }
}

void StreamTags::untag_marker(std::uint64_t marker) noexcept {
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    if (pending_[i].marker == marker) {
      untag(i);  // its release is deferred: the marker is still kept
      return;
    }
  }
}

void StreamTags::end_wait() noexcept {
  for (std::size_t i = 0; i < waiting_.size(); ++i) {
    if (waited_done_[i] != 0) untag_marker(waiting_[i]);
    unkeep(waiting_[i]);
  }
  waiting_.clear();
  waited_done_.clear();
}

std::size_t StreamTags::begin_query(std::uint64_t* markers, std::size_t most) noexcept {
  const std::size_t total = pending_.size();
  if (total == 0) return 0;
  const std::size_t count = std::min(total, most);
  const std::size_t first = query_cursor_ % total;
  std::size_t listed = 0;
  for (std::size_t k = 0; k < count; ++k) {
    const std::uint64_t marker = pending_[(first + k) % total].marker;
    if (!keep(marker)) break;  // no host memory: fewer this time
    markers[listed++] = marker;
  }
  query_cursor_ = first + listed;
  return listed;
}

void StreamTags::end_query(const std::uint64_t* markers, const bool* done,
                           std::size_t count) noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    if (done[i]) untag_marker(markers[i]);
    unkeep(markers[i]);
  }
}

void StreamTags::untag(std::size_t i) noexcept {
  Pending& p = pending_[i];
  release(p.marker);
  for (Range* r : p.ranges) {
    r->tag = kUntagged;
    ranges_.insert_free(r);
  }
  drop(i);
}

void StreamTags::poll() noexcept {
  for (std::size_t i = 0; i < pending_.size();) {
    if (fence_.completed(pending_[i].marker)) {
      untag(i);
    } else {
      ++i;
    }
  }
}

bool StreamTags::fence_other_streams(StreamKey except, std::size_t need) noexcept {
  const std::vector<FreeRanges::StreamIndex>& streams = ranges_.streams();
  bool listed = false;
  for (std::size_t slot = 0; slot < streams.size(); ++slot) {
    const FreeRanges::Index& index = *streams[slot].index;
    if (streams[slot].key == except || index.empty()) continue;
    bool serves = need == 0;
    if (!serves) index.for_each([&](const Range* r) { serves = serves || could_serve(r, need); });
    if (serves && fence_stream(slot)) listed = true;
  }
  return listed;
}

void StreamTags::fence(StreamKey key) noexcept {
  const std::size_t slot = ranges_.stream_slot(key);
  if (slot != ranges_.streams().size()) (void)fence_stream(slot);
}

bool StreamTags::fence_stream(std::size_t slot) noexcept {
  const StreamKey key = ranges_.streams()[slot].key;
  if (wants_ != nullptr && !always_recordable(key)) {
    wants_->want(key);  // recorded by the stream's next call (adopt)
    return false;
  }
  if (std::find(to_record_.begin(), to_record_.end(), key) != to_record_.end()) return true;
  try {
    to_record_.push_back(key);
  } catch (...) {  // no host memory: these ranges stay with their stream
    return false;
  }
  return true;
}

bool StreamTags::take_listed(std::vector<Record>& out) noexcept {
  out.clear();
  try {
    out.reserve(to_record_.size());
  } catch (...) {  // no host memory: nothing recorded, the ranges keep their streams
    to_record_.clear();
    return false;
  }
  for (const StreamKey key : to_record_) out.push_back(Record{key});  // reserved: no throw
  to_record_.clear();
  return !out.empty();
}

void StreamTags::record_outside(std::vector<Record>& records) noexcept {
  for (Record& r : records) {
    try {
      r.marker = fence_.record(fence_stream_of(r.key));
    } catch (...) {  // captured, or a driver error: the ranges keep their tag
      continue;
    }
    r.recorded = true;
    r.done = fence_.completed(r.marker);
  }
}

void StreamTags::end_record(const std::vector<Record>& records, std::uint64_t mark) noexcept {
  for (const Record& r : records) {
    if (!r.recorded) continue;
    if (!adopt(r.key, r.marker, mark)) {
      fence_.release(r.marker);  // nothing freed before the mark is left (taken meanwhile)
    } else if (r.done) {
      untag(pending_.size() - 1);  // adopt() appended its entry
    }
  }
}

bool StreamTags::file_pending(Range* r, std::uint64_t marker, const void* recorder) noexcept {
  Pending* joined = nullptr;
  for (Pending& p : pending_) {
    if (p.stream == r->tag && recorder != nullptr && p.recorder == recorder &&
        p.ranges.size() < kMaxJoined) {
      joined = &p;
      break;
    }
  }
  try {
    if (joined != nullptr) {
      joined->ranges.push_back(r);
    } else {
      pending_.push_back(Pending{marker, r->tag, {r}, recorder});
    }
  } catch (...) {  // no host memory: the caller frees r under its tag
    return false;
  }
  if (joined != nullptr) {
    release(joined->marker);  // deferred while kept (queried with the mutex released)
    joined->marker = marker;
  }
  r->state = Range::State::pending;
  r->bin_prev = r->bin_next = nullptr;
  r->index = nullptr;
  if (joined != nullptr) merge_in_entry(*joined, r);
  return true;
}

void StreamTags::merge_in_entry(Pending& entry, Range* r) noexcept {
  // Its neighbours in the same entry are covered by the entry's one marker: one range, so the
  // stream's own larger requests find it (own_pending_fit()).
  auto erase = [&entry](Range* gone) {
    auto it = std::find(entry.ranges.begin(), entry.ranges.end(), gone);
    *it = entry.ranges.back();
    entry.ranges.pop_back();
  };
  auto in_entry = [&entry, r](const Range* n) {
    return n != nullptr && n->state == Range::State::pending && n->tag == r->tag &&
           std::find(entry.ranges.begin(), entry.ranges.end(), n) != entry.ranges.end();
  };
  if (in_entry(r->next)) {
    erase(r->next);
    ranges_.merge_pending(r);
  }
  if (in_entry(r->prev)) {
    erase(r);
    ranges_.merge_pending(r->prev);
  }
}

StreamTags::Range* StreamTags::own_pending_fit(StreamKey stream, std::size_t need,
                                               bool stretch) const noexcept {
  Range* alone = nullptr;   // spans `need` itself: the smallest
  Range* joined = nullptr;  // with its untagged next neighbour: the smallest pair
  std::size_t joined_size = 0;
  for (const Pending& p : pending_) {
    if (p.stream != stream) continue;
    for (Range* r : p.ranges) {
      std::size_t size = r->size;
      if (size >= need) {
        if (alone != nullptr && size >= alone->size) continue;
      } else {
        const Range* next = r->next;
        if (!stretch || alone != nullptr || next == nullptr || next->state != Range::State::free ||
            next->tag != kUntagged) {
          continue;
        }
        size += next->size;
        if (size < need || (joined != nullptr && size >= joined_size)) continue;
      }
      // Virtual mode: an adopted range may span never-mapped granules (a stream's free merges
      // with the untagged tail), and an untagged neighbour may too; only one mapped under
      // `need` serves without growing.
      if (map_.base() != nullptr && !map_.mapped_under(r, need)) continue;
      if (r->size >= need) {
        alone = r;
      } else {
        joined = r;
        joined_size = size;
      }
    }
  }
  return alone != nullptr ? alone : joined;
}

void StreamTags::take_pending(Range* r, std::size_t need) noexcept {
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    if (p.stream != r->tag) continue;
    auto it = std::find(p.ranges.begin(), p.ranges.end(), r);
    if (it == p.ranges.end()) continue;
    if (r->size > need) {
      if (Range* rest = ranges_.split_pending(r, need)) {
        *it = rest;  // in r's place: still under the entry's marker
        return;
      }
    }
    *it = p.ranges.back();
    p.ranges.pop_back();
    if (p.ranges.empty()) {
      release(p.marker);
      drop(i);
    }
    if (r->size < need) ranges_.take_with_untagged_next(r, need);
    return;
  }
}

bool StreamTags::adopt(StreamKey key, std::uint64_t marker, std::uint64_t mark) noexcept {
  const std::size_t slot = ranges_.stream_slot(key);
  if (slot == ranges_.streams().size()) return false;
  Pending p{marker, key, {}};
  try {
    // Ranges freed after the mark may be used by work queued after the marker: they stay.
    ranges_.streams()[slot].index->for_each([&p, mark](Range* r) {
      if (r->epoch < mark) p.ranges.push_back(r);
    });
    if (p.ranges.empty()) return false;
    pending_.push_back(std::move(p));
  } catch (...) {  // no host memory: the ranges stay with their stream
    return false;
  }
  for (Range* r : pending_.back().ranges) {
    ranges_.remove_free(r);  // may drop the emptied index (slot not used after this)
    r->state = Range::State::pending;
    r->bin_prev = r->bin_next = nullptr;
    r->index = nullptr;
  }
  return true;
}

bool StreamTags::stranded(StreamKey except, std::size_t need, bool whole_segments) const noexcept {
  if (wants_ == nullptr) return false;
  for (const FreeRanges::StreamIndex& stream : ranges_.streams()) {
    if (stream.key == except || always_recordable(stream.key)) continue;
    bool found = false;
    stream.index->for_each([&](const Range* r) {
      found = found || could_serve(r, need) ||
              (whole_segments && r->prev == nullptr && r->next == nullptr);
    });
    if (found) return true;
  }
  return false;
}

bool StreamTags::take_back(StreamKey stream) noexcept {
  bool taken = false;
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    if (p.stream != stream || p.recorder != nullptr) {
      ++i;
      continue;
    }
    release(p.marker);
    for (Range* r : p.ranges) ranges_.insert_free(r);  // tag still `stream`: filed as its own
    drop(i);
    taken = true;
  }
  return taken;
}

bool StreamTags::could_serve(const Range* r, std::size_t need) const noexcept {
  // The stretch of ranges around r that are free (any tag) or pending: once untagged they
  // merge into one. Virtual mode counts only bytes below the highest granule ever mapped:
  // the never-mapped rest of the reservation serves any stream without a fence, so a range
  // beside it is no reason to fence or wait.
  auto unused = [](const Range* n) { return n != nullptr && n->state != Range::State::used; };
  const char* begin = r->addr;
  const char* end = r->addr + r->size;
  for (const Range* n = r->prev; unused(n); n = n->prev) begin = n->addr;
  for (const Range* n = r->next; unused(n); n = n->next) end = n->addr + n->size;
  if (map_.base() != nullptr) end = std::min<const char*>(end, map_.mapped_end());
  return end > begin && static_cast<std::size_t>(end - begin) >= need;
}

void StreamTags::forget(std::uint64_t mark) noexcept {
  // A pending range keeps its own epoch (the later one of those it merged in its entry: it
  // stays pending past a mark that one of them came after).
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    auto older = std::partition(p.ranges.begin(), p.ranges.end(),
                                [mark](const Range* r) { return r->epoch >= mark; });
    for (auto it = older; it != p.ranges.end(); ++it) {
      (*it)->tag = kUntagged;
      ranges_.insert_free(*it);
    }
    p.ranges.erase(older, p.ranges.end());
    if (!p.ranges.empty()) {  // freed after the mark: still waits for its marker
      ++i;
      continue;
    }
    release(p.marker);
    drop(i);
  }
  // Untagging merges a range only with untagged neighbours, so every range collected here
  // stays alive until its own turn.
  std::vector<Range*> tagged;
  try {
    for (const FreeRanges::StreamIndex& stream : ranges_.streams()) {
      stream.index->for_each([&tagged, mark](Range* r) {
        if (r->epoch < mark) tagged.push_back(r);
      });
    }
  } catch (...) {  // no host memory for the list: the ranges keep their streams
    return;
  }
  for (Range* r : tagged) {
    ranges_.remove_free(r);
    r->tag = kUntagged;
    ranges_.insert_free(r);
  }
}

void StreamTags::release_markers() noexcept {
  for (Pending& p : pending_) fence_.release(p.marker);
  pending_.clear();
}

}  // namespace vram::detail
